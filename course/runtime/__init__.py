"""What a kernel file imports, and nothing else of ``course`` does this part import.

``validation`` (every check of a call's inputs, with its message), ``compile`` (cross-compiling for
sm_90 and the symbolic tensors), ``launch`` (compiled-kernel cache, launch plans, decode workspace),
``prefill`` (the one host function of every prefill stage), ``kv_cache`` (FP8 quantization),
``shapes`` (a call's shapes, named) and ``stages`` (the registry of stage files and how to load one).
"""
