"""commfuse benchmark runner: workloads x baselines measured side by side in one run.

Entry point: ``python benchmarks/run.py --suite quick|full --json out.json [--plot DIR]``.
See docs/benchmarks.md. The pieces are small registries so that new code can
add a workload, a baseline or a metric with one registration:

* :mod:`benchmarks.workloads` -- example models at named sizes (``family:size``);
* :mod:`benchmarks.baselines` -- how a model is run (eager, Inductor, commfuse, ...);
* :mod:`benchmarks.metrics`   -- columns computed from the raw per-rank measurements;
* :mod:`benchmarks.measure`   -- the job every gloo rank runs for one workload x baseline;
* :mod:`benchmarks.scaling`   -- compile-time scaling of the pipeline on deep Llama graphs;
* :mod:`benchmarks.suites`    -- which workloads / baselines / layer counts a suite runs;
* :mod:`benchmarks.report`    -- environment, JSON, text table and plots.
"""
