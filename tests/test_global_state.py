"""The autouse ``no_leaked_global_state`` fixture (tests/conftest.py) and its helpers
(tests/_global_state.py): a change to process-global state is found, named and put back."""

from __future__ import annotations

import io
import logging
import os
import shutil
from pathlib import Path

import torch
from torch._logging import _internal as torch_logs

import _global_state
import commfuse
from commfuse.core.torch_private import structured_trace_enabled

TESTS = Path(__file__).resolve().parent


def test_each_area_s_change_is_found_and_put_back():
    before = _global_state.snapshot()
    assert _global_state.diff(before, _global_state.snapshot()) == []
    assert not structured_trace_enabled()

    trace = logging.StreamHandler(io.StringIO())
    try:
        os.environ["COMMFUSE_TEST_LEAK_PROBE"] = "1"
        torch._inductor.config.max_autotune = not torch._inductor.config.max_autotune
        torch._inductor.config.post_grad_fusion_options["probe"] = {}  # in place, on the default dict
        torch._dynamo.config.recompile_limit += 1
        logging.getLogger("commfuse").setLevel(logging.DEBUG)
        torch_logs.log_state.log_qname_to_level["commfuse"] = logging.DEBUG
        torch_logs.trace_log.addHandler(trace)
        commfuse.set_default_config(commfuse.Config(strict=True))
        torch.set_default_dtype(torch.float64)
        assert structured_trace_enabled()
    finally:
        changes = _global_state.diff(before, _global_state.snapshot())
        _global_state.restore(changes)
    found = {key for key, _, _ in changes}
    assert found == {
        ("os.environ", "COMMFUSE_TEST_LEAK_PROBE"),
        ("torch._inductor.config", "max_autotune"),
        ("torch._inductor.config", "post_grad_fusion_options"),
        ("torch._dynamo.config", "recompile_limit"),
        ("logging", "commfuse"),
        ("logging", "torch.__trace"),
        ("torch._logging", "log_state.log_qname_to_level"),
        ("torch._logging", "trace handlers"),
        ("commfuse", "config._process_default"),
        ("torch", "default dtype"),
    }, found
    text = _global_state.describe(changes)
    assert "os.environ: COMMFUSE_TEST_LEAK_PROBE: (unset) -> '1'" in text
    assert "torch._inductor.config: max_autotune: " in text
    assert _global_state.diff(before, _global_state.snapshot()) == []
    assert not structured_trace_enabled() and commfuse.default_config() == commfuse.Config()


def test_a_logger_that_first_appears_during_a_test_is_not_a_change():
    before = _global_state.snapshot()
    logging.getLogger("commfuse.test_global_state.new_logger_probe")
    assert _global_state.diff(before, _global_state.snapshot()) == []


def test_the_fixture_fails_the_leaking_test_and_the_next_test_sees_the_state_put_back(pytester):
    """The suite's own conftest in a pytest run of its own: the test that leaks errors at teardown
    with what it changed; the test after it, in the same process, finds the state as before."""
    shutil.copy(TESTS / "conftest.py", pytester.path / "conftest.py")
    pytester.makepyfile(
        test_leaks="""
        import os
        import commfuse

        def test_leaks():
            os.environ["COMMFUSE_TEST_LEAK_PROBE"] = "1"
            commfuse.set_default_config(commfuse.Config(strict=True))

        def test_after():
            assert "COMMFUSE_TEST_LEAK_PROBE" not in os.environ
            assert commfuse.default_config() == commfuse.Config()

        def test_restores_through_monkeypatch(monkeypatch):
            monkeypatch.setenv("COMMFUSE_TEST_LEAK_PROBE", "1")
        """
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaks*",
            "*left process-global state changed*",
            "*commfuse: config._process_default: None -> Config(*",
            "*os.environ: COMMFUSE_TEST_LEAK_PROBE: (unset) -> '1'*",
        ]
    )
