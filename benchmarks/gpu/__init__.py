"""GPU mode of the benchmark runner (``python benchmarks/run.py --gpu``): docs/benchmarks.md, "GPU mode".

* :mod:`benchmarks.gpu.wheels` -- unpacks the carried wheels (pydantic) where the image lacks them;
* :mod:`benchmarks.gpu.checks` -- runtime + stream program, Inductor regions, DHelix on one rank;
* :mod:`benchmarks.gpu.kernels` -- compute model vs measured kernel times of an 8B-class layer;
* :mod:`benchmarks.gpu.mode` -- runs the parts, writes ``gpu-<date>.json`` / ``.md``.

Importing this package imports nothing else: the wheels must be in place before commfuse is.
"""
