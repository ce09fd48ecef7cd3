"""llama.cpp runs in a child process: its crashes become one-line errors, and the build is checked here.

The build check is what would have caught the "Illegal instruction" of a natively built llama.cpp on a CPU
that advertises AMX: it evaluates quantized GGUF files (ggml's matrix kernels) and fails with the signal
and the fix, while the features the build uses are printed at the end of every pytest run.
"""

from __future__ import annotations

import os
import signal

import pytest

from child_helpers import die, hang, remember
from compress.errors import CompressError
from compress.eval.llama_cpp_worker import LlamaCppCrash, LlamaCppWorker, describe_exit
from conftest import EVAL_TEXT, REFERENCE_MODEL


def test_llama_cpp_build_runs_quantized_files_here(llama_cpp_check):
    """Fails (not crashes) where the installed llama.cpp cannot run on this CPU; names the features."""
    if isinstance(llama_cpp_check, LlamaCppCrash):
        pytest.fail(str(llama_cpp_check), pytrace=False)
    assert "AVX" in llama_cpp_check.system_info or "NEON" in llama_cpp_check.system_info
    assert llama_cpp_check.files == ["reference-q4_0.gguf", "reference-q4_k_m.gguf"]


@pytest.mark.parametrize("signum, words", [(signal.SIGILL, "CMAKE_ARGS"), (signal.SIGKILL, "memory"), (signal.SIGSEGV, "portable CMAKE_ARGS")])
def test_a_child_killed_by_a_signal_is_one_line_naming_file_and_signal(signum, words):
    with LlamaCppWorker("model-q4_k.gguf") as worker:
        pid = worker.pid
        with pytest.raises(LlamaCppCrash) as err:
            worker.call(die, int(signum), doing="evaluating")
    message = str(err.value)
    assert "\n" not in message and "model-q4_k.gguf" in message and signum.name in message and words in message
    assert message.startswith("llama.cpp died evaluating model-q4_k.gguf")
    assert err.value.signal_name == signum.name and isinstance(err.value, CompressError)
    with pytest.raises(ProcessLookupError):  # the child is gone, and we are still here
        os.kill(pid, 0)


def test_state_persists_between_calls_and_errors_in_the_child_are_reported():
    with LlamaCppWorker("x.gguf") as worker:
        assert worker.call(remember, "a", 1) == ["a"]
        assert worker.call(remember, "b", 2) == ["a", "b"]
        with pytest.raises(CompressError, match=r"^llama.cpp failed running x.gguf: TypeError") as err:
            worker.call(remember, "only-two-args")
        assert not isinstance(err.value, LlamaCppCrash)
        assert worker.call(remember, "c", 3) == ["a", "b", "c"]  # the child survived its exception


def test_a_hung_child_is_killed_at_the_timeout():
    with LlamaCppWorker("slow.gguf", timeout=1.0) as worker:
        with pytest.raises(LlamaCppCrash, match=r"^llama.cpp gave no answer evaluating slow.gguf within 1 s: stopped it$"):
            worker.call(hang, doing="evaluating")


def test_exit_descriptions():
    assert describe_exit(-int(signal.SIGILL))[1] == "SIGILL"
    assert describe_exit(3) == ("exit status 3", None)


def test_a_file_llama_cpp_refuses_is_an_error_not_a_crash(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install -e '.[gguf]'")
    from compress.eval.llama_cpp_worker import LlamaCppModel

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(CompressError, match="bad.gguf"):
        LlamaCppModel(bad)


# -- compress report: a crash in llama.cpp falls back to dequantizing, and says so ----------------------
@pytest.fixture(scope="module")
def q8_file(tmp_path_factory):
    from compress.export.gguf import ExportConfig, export_gguf
    from compress.formats.gguf.plan import Target

    path = tmp_path_factory.mktemp("crash-report") / "ref-q8_0.gguf"
    export_gguf(ExportConfig(REFERENCE_MODEL, path, Target.q8_0))
    return path


def crash_on_decode(monkeypatch):
    """`compress report`'s llama.cpp model, made to die with SIGILL in its first decode (the real failure)."""
    import compress.eval.report as report
    from compress.eval.llama_cpp_worker import LlamaCppModel

    class SigillOnDecode(LlamaCppModel):
        def __call__(self, input_ids, use_cache=False):
            self.worker.call(die, int(signal.SIGILL), doing="evaluating")

    monkeypatch.setattr(report, "LlamaCppModel", SigillOnDecode)
    monkeypatch.setattr(report, "llama_cpp_available", lambda: True)


def test_report_auto_backend_falls_back_and_marks_the_row(monkeypatch, q8_file, tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed: pip install -e '.[gguf]'")
    from typer.testing import CliRunner

    from compress.cli import app
    from compress.eval.report import Evaluator, GGUFBackend, Protocol, evaluate_outputs

    crash_on_decode(monkeypatch)
    protocol = Protocol(EVAL_TEXT, ctx=256, max_tokens=1024)
    fell_back = evaluate_outputs([q8_file], REFERENCE_MODEL, protocol, GGUFBackend.AUTO).rows[0]
    dequantized = evaluate_outputs([q8_file], REFERENCE_MODEL, protocol, GGUFBackend.DEQUANTIZE).rows[0]
    assert fell_back.evaluator == Evaluator.LLAMA_CPP_CRASHED.value == "gguf-py dequantized (llama.cpp crashed)"
    assert fell_back.kld == pytest.approx(dequantized.kld, rel=1e-6) and fell_back.kld > 0

    args = ["report", str(q8_file), "--baseline", str(REFERENCE_MODEL), "--text", str(EVAL_TEXT), "--ctx", "256",
            "--max-tokens", "512", "-o", str(tmp_path / "rep")]
    forced = CliRunner().invoke(app, [*args, "--gguf-backend", "llama-cpp"])
    assert forced.exit_code == 2, forced.output
    line = forced.output.strip().splitlines()[-1]  # after the progress bars
    assert line.startswith("error: llama.cpp died evaluating ref-q8_0.gguf (SIGILL") and "Traceback" not in forced.output
