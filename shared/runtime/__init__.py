"""The fast CPU runtime: the Llama/Qwen2 runner with packed weights and a native int8 kernel per
instruction set (``native/``, built by ``pip install``), GGUF weights read layer by layer, and
what this machine can run (``doctor``)."""
