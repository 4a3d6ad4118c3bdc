"""What people run around the kernels, ``python -m course`` first: ``cli`` (status, check), ``skeleton``
(learner files from the solutions), ``diffs`` and ``transcripts`` (generated docs), ``notebooks``,
``bench``, ``host_bench`` and ``model_bench`` (measurements) with ``results`` (their pages), ``sass``,
``sanitize`` and ``constraints``. Tools may import every other part."""
