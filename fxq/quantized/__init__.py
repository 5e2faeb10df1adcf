"""Integer modules and the integer kernels (``fxq.quantized.functional``)."""
