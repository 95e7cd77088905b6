"""benchmarks/trace_table.py's host self time: nested scopes on one thread line."""
import pathlib
import sys
from types import SimpleNamespace as Event

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import trace_table  # noqa: E402


def _line(*events):
    return Event(events=[Event(name=n, start_ns=s, duration_ns=d) for n, s, d in events])


def test_self_time_subtracts_nested_events_only():
    # step [0, 100) holds gemm [10, 40) (which holds launch [12, 20)) and quantize [50, 60);
    # a second thread's wait [0, 90) is its own.
    lines = [_line(("step", 0, 100), ("gemm", 10, 30), ("launch", 12, 8), ("quantize", 50, 10)),
             _line(("wait", 0, 90)), _line()]
    own, inclusive, threads = trace_table.self_times(lines)
    assert dict(own) == {"step": 60, "gemm": 22, "launch": 8, "quantize": 10, "wait": 90}
    assert inclusive["step"] == 100 and inclusive["gemm"] == 30
    assert threads == 2


def test_self_time_sums_repeated_names():
    own, inclusive, _ = trace_table.self_times([_line(("thunk", 0, 10), ("thunk", 20, 5))])
    assert own["thunk"] == 15 and inclusive["thunk"] == 15
