"""The kernels inside PyTorch and transformers: ``ops`` registers ``torch.ops.course.attention`` and
``torch.ops.course.decode_attention`` (custom ops that torch.compile traces); ``models`` is the
"course" attention backend of transformers models, built on them."""
