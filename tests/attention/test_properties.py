"""Property-based: hypothesis draws whole configurations (batch, lengths, heads and groups,
head dims, mask, window, segments, bias, softmax, soft cap, dropout) and every backend that
claims the features (`test_behaviour.CAPABILITIES`) must agree with the float64 reference,
whose forward is checked against the brute-force oracle on the same draw.

Shapes come from small sets, so that eager dispatch reuses compiled operations across draws;
max_examples is small and the deadline off, to keep the suite fast and free of timing flakes.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import semantics as sem
from flashmesh.attention import normalize, registry
from test_behaviour import (CAPABILITIES, GPU_BACKENDS, Case, case_features, compare_results,
                            expected_of, make_inputs, options_of, plain_of, run, supports, float32_by_rule,
                            float32_precision)

F64 = dict(rtol=1e-10, atol=1e-10)


@st.composite
def configs(draw) -> tuple[Case, int]:
    B = draw(st.sampled_from([1, 2]))
    T = draw(st.sampled_from([1, 6, 16, 23]))
    S = draw(st.sampled_from([T, 5, 16, 23]))
    K, G = draw(st.sampled_from([(1, 1), (2, 1), (1, 4), (2, 2)]))  # kv heads, group size
    Dqk, Dv = draw(st.sampled_from([(8, 8), (16, 8), (8, 16)]))
    segments = draw(st.sampled_from([None, None, "seqlens", "seqlens_empty_row", "offsets",
                                     "offsets_empty_row", "ids", "ids_pos_shifted"]))
    causal = draw(st.sampled_from(["none", "causal", "causal_bottom_right"]))
    if causal == "causal_bottom_right" and segments in ("ids_pos_shifted",):
        causal = "causal"  # positions the user chose cannot be shifted to the bottom right
    mask = causal if segments is None else ("padding" if causal == "none" else f"padding_{causal}")
    left = draw(st.sampled_from([-1, -1, 0, 2, 7]))
    right = 0 if causal != "none" else draw(st.sampled_from([-1, -1, 0, 3]))
    window = None if (left, right) in ((-1, -1), (-1, 0)) else (left, right)
    bias = draw(st.sampled_from([None, None, *sem.BIAS_SHAPES]))
    softmax = draw(st.sampled_from(["vanilla", "off_by_one", "learnable"]))
    soft_cap = draw(st.sampled_from([None, None, 3.0]))
    dropout = draw(st.sampled_from([0.0, 0.0, 0.0, 0.25]))
    seed = draw(st.integers(0, 2**31 - 1))
    case = Case(B=B, T=T, S=S, N=K * G, K=K, Dqk=Dqk, Dv=Dv, mask=mask, window=window,
                segments=segments, bias=bias, softmax=softmax, soft_cap=soft_cap, dropout=dropout)
    return case, seed


def _backends():
    on_gpu = registry.current_platform() == "gpu"
    return [b for b in CAPABILITIES if b != "reference" and (on_gpu or b not in GPU_BACKENDS)]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          print_blob=True)
@given(configs())
def test_backends_agree_with_reference(config):
    case, seed = config
    x = make_inputs(case, seed)
    want = expected_of(case, x, jit=True)  # shapes vary per draw: one compile beats many

    # The float64 reference itself against the brute-force oracle (forward; cheap).
    keep = None
    if case.dropout:
        inputs, _ = normalize(x.q, x.k, x.v, sink=x.sink, **options_of(case, x))
        keep = sem.dropout_keep_mask(inputs.dropout_seed, case.dropout, case.B, case.N, case.T, case.S)
    oracle_out, oracle_lse = sem.attention(
        x.q, x.k, x.v, mask=case.mask, window=case.window, segments=x.segments, bias=x.bias,
        sink=x.sink, softmax=case.softmax, logits_soft_cap=case.soft_cap, keep=keep,
        dropout_rate=case.dropout)
    sem.assert_close("reference out vs oracle", want[0], oracle_out, **F64)
    sem.assert_close("reference lse vs oracle", want[1], oracle_lse, **F64)

    for backend in _backends():
        dtype = "float32" if "float32" in CAPABILITIES[backend] else "bfloat16"
        if not supports(backend, case_features(case, x, dtype)):
            with pytest.raises(NotImplementedError):
                run(case, x, backend, dtype)
            continue
        with float32_precision(dtype):
            got = run(case, x, backend, dtype)
            by_rule = dtype == "bfloat16" or float32_by_rule()
            plain = plain_of(case, x, dtype) if by_rule else None
        compare_results(f"{backend}/{dtype} {case}", case, x, dtype, got, want, plain)
