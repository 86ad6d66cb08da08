"""What every rank process of the test session runs before its first job (tests/conftest.py
installs it with commfuse.testing.set_worker_initializer)."""

from __future__ import annotations

from typing import Any, Optional


def agreement_net_off_unless_asked() -> None:
    """Compiles whose Config leaves ``check_agreement`` unset run without the cross-rank
    agreement net in this process. The net compiles every frame a second time, as written, and
    compiles the backward with the forward: a third of a multi-rank test's compile time (a 4-rank
    DHelix TP+SP test: 2122 of 5890 samples of the ranks' main threads in _compile_as_written)
    while what these tests check is the passes against eager. The net's own tests say
    ``check_agreement`` in their Config and run it (tests/_jobs_agreement.py)."""
    import importlib

    from commfuse.config import Config, default_config

    # the module, not the function commfuse.backend that the package exports under its name
    backend_module = importlib.import_module("commfuse.backend")

    init = backend_module.CommfuseBackend.__init__
    if getattr(init, "_suite_net_off", False):
        return

    def __init__(self, config: Optional[Config] = None, **kwargs: Any) -> None:
        config = config or default_config()
        if "check_agreement" not in config.model_fields_set:
            config = config.model_copy(update={"check_agreement": "off"})
        init(self, config, **kwargs)

    __init__._suite_net_off = True  # type: ignore[attr-defined]
    backend_module.CommfuseBackend.__init__ = __init__  # type: ignore[method-assign]
