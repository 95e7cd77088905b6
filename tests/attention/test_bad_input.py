"""Bad input gets a one-line ValueError that names the argument; a backend that cannot run a
call raises NotImplementedError with its reason; `explain` lists every implementation."""

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flashmesh
from flashmesh import SequenceDescriptor as SD
from flashmesh.attention import IMPLEMENTATIONS, registry

B, T, N, K, H = 2, 8, 4, 2, 16
Q = np.random.default_rng(0).standard_normal((B, T, N, H)).astype(np.float32)
KV = np.random.default_rng(1).standard_normal((B, T, K, H)).astype(np.float32)
IDS = np.ones((B, T), np.int32)


def call(q=Q, k=KV, v=KV, **options):
    options.setdefault("implementation", "reference")
    return flashmesh.attention(q, k, v, **options)


def desc(f, *args, **kw):
    return lambda: getattr(SD, f)(*args, **kw)


# (id, what raises, a regex the message must match: it names the argument)
BAD = [
    # ranks, shapes, dtypes
    ("q_rank_3", lambda: call(q=Q[0]), r"q must have rank 4"),
    ("k_rank_5", lambda: call(k=KV[None]), r"k must have rank 4"),
    ("v_rank_3", lambda: call(v=KV[0]), r"v must have rank 4"),
    ("sbhd_rank", lambda: call(q=Q[0], layout="sbhd"), r"q must have rank 4 \(\[S, B, N, H\]\)"),
    ("dtypes_differ", lambda: call(q=Q.astype(jnp.bfloat16)), r"q, k, v dtypes must match"),
    ("f16_vs_bf16", lambda: call(q=Q.astype(np.float16), k=KV.astype(jnp.bfloat16),
                                 v=KV.astype(jnp.bfloat16)), r"dtypes must match"),
    ("q_int", lambda: call(q=Q.astype(np.int32)), r"q must be a floating-point array"),
    ("v_int", lambda: call(v=KV.astype(np.int32)), r"v must be a floating-point array"),
    ("q_complex", lambda: call(q=Q.astype(np.complex64)), r"q must be a floating-point array"),
    ("heads_not_multiple", lambda: call(k=KV[:, :, :1].repeat(3, 2), v=KV[:, :, :1].repeat(3, 2)),
     r"num_heads=4 must be a multiple of num_kv_heads=3"),
    ("batch_differs", lambda: call(k=KV[:1], v=KV[:1]), r"batch sizes differ: q 2, k 1"),
    ("v_length_differs", lambda: call(v=KV[:, :5]), r"v shape .* must match k shape"),
    ("k_head_dim", lambda: call(k=KV[..., :8]), r"k head dim 8 must equal q head dim 16"),
    ("empty_dim", lambda: call(q=Q[:, :0]), r"empty dimension in q"),
    # masks and windows
    ("unknown_mask", lambda: call(mask="causl"), r"mask='causl' must be one of"),
    ("causal_right_window", lambda: call(mask="causal", window=(2, 1)), r"window=\(2, 1\) has right > 0"),
    ("causal_right_only", lambda: call(mask="causal", window=(-1, 5)), r"window=\(-1, 5\) has right > 0"),
    ("window_one_item", lambda: call(window=(3,)), r"window must be a \(left, right\) pair"),
    ("window_three_items", lambda: call(window=(1, 2, 3)), r"window must be a \(left, right\) pair"),
    ("window_below_minus_one", lambda: call(window=(-2, 0)), r"window must be .* >= -1"),
    ("window_float", lambda: call(window=(1.5, 0)), r"window must be a \(left, right\) pair of ints"),
    ("window_none_item", lambda: call(window=(1, None)), r"window must be a \(left, right\) pair"),
    ("window_string", lambda: call(window="left"), r"window must be a \(left, right\) pair"),
    ("padding_mask_needs_segments", lambda: call(mask="padding"), r"mask='padding' needs segments"),
    # segments
    ("segments_not_descriptor", lambda: call(segments=IDS), r"segments must be a SequenceDescriptor"),
    ("segment_ids_rank", desc("from_segment_ids_and_pos", IDS[0]), r"q segment_ids must have shape \[B, L\]"),
    ("segment_ids_length", lambda: call(segments=SD.from_segment_ids_and_pos(IDS[:, :7])),
     r"q segment_ids length 7 must equal the sequence length 8"),
    ("kv_segment_ids_length", lambda: call(segments=SD.from_segment_ids_and_pos((IDS, IDS[:, :5]))),
     r"kv segment_ids length 5 must equal the sequence length 8"),
    ("segment_ids_batch_vs_q", lambda: call(segments=SD.from_segment_ids_and_pos(np.ones((3, T), np.int32))),
     r"segments batch 3 must equal q batch 2"),
    ("segment_ids_q_kv_batch", desc("from_segment_ids_and_pos", (IDS, IDS[:1])),
     r"segment_ids batch sizes differ"),
    ("segment_pos_shape", desc("from_segment_ids_and_pos", IDS, IDS[:, :5]),
     r"q segment_pos shape \(2, 5\) must equal its segment_ids shape \(2, 8\)"),
    ("kv_segment_pos_shape", desc("from_segment_ids_and_pos", IDS, (IDS, IDS[:, :5])),
     r"kv segment_pos shape"),
    ("negative_segment_ids", desc("from_segment_ids_and_pos", -IDS), r"q segment_ids must be >= 0"),
    # Positions the user chose (not offsets from each segment's start) would be shifted twice.
    ("bottom_right_non_canonical_pos", lambda: call(mask="causal_bottom_right",
                                                    segments=SD.from_segment_ids_and_pos(IDS, IDS)),
     r"a bottom-right mask shifts each segment's diagonal, so segment_pos must be offsets from "
     r"each segment's start, got q segment_pos\[0, 0\] = 1 where the offset is 0"),
    ("bottom_right_traced_pos", lambda: jax.jit(lambda pos: call(
        mask="padding_causal_bottom_right", segments=SD.from_segment_ids_and_pos(IDS, pos)))(IDS * 0),
     r"segment_pos must be offsets .* got traced q segment_pos"),
    # Non-integer descriptors would be truncated (2.7 -> 2) by the int32 cast.
    ("seqlens_float", desc("from_seqlens", np.array([3.0, 4.0])),
     r"seqlens must be an integer array, got dtype float"),
    ("kv_seqlens_float", desc("from_seqlens", (np.array([3, 4]), np.array([3.5, 4.0]))),
     r"kv seqlens must be an integer array, got dtype float"),
    ("offsets_float", desc("from_seqlens_and_offsets", np.array([[3, 4]] * 2),
                           np.array([[0.0, 3.0]] * 2)), r"offsets must be an integer array"),
    ("segment_ids_float", desc("from_segment_ids_and_pos", IDS.astype(np.float32)),
     r"segment_ids must be an integer array, got dtype float32"),
    ("segment_ids_bool", desc("from_segment_ids_and_pos", IDS.astype(bool)),
     r"segment_ids must be an integer array, got dtype bool"),
    ("segment_pos_float", desc("from_segment_ids_and_pos", IDS, np.zeros((B, T), np.float32)),
     r"segment_pos must be an integer array, got dtype float32"),
    ("seqlens_rank", desc("from_seqlens", IDS), r"q seqlens must have shape \[B\]"),
    ("seqlens_negative", desc("from_seqlens", np.array([-1, 3])), r"q seqlens must be >= 0"),
    ("seqlens_too_long", lambda: call(mask="padding", segments=SD.from_seqlens(np.array([9, 3]))),
     r"q seqlens must be <= the sequence length 8, got max 9"),
    ("kv_seqlens_too_long", lambda: call(mask="padding", segments=SD.from_seqlens(
        (np.array([3, 3]), np.array([3, 12])))), r"kv seqlens must be <= the sequence length 8"),
    ("seqlens_batch_vs_q", lambda: call(mask="padding", segments=SD.from_seqlens(np.array([1, 2, 3]))),
     r"segments batch 3 must equal q batch 2"),
    ("seqlens_pair_items", desc("from_seqlens", (np.array([1, 2]),) * 3),
     r"seqlens must be one array or a \(q, kv\) pair"),
    ("offsets_rank", desc("from_seqlens_and_offsets", np.array([3, 4]), np.array([0, 0])),
     r"q seqlens must have shape \[B, M\]"),
    ("offsets_shape", desc("from_seqlens_and_offsets", np.array([[3, 4]] * 2), np.array([[0]] * 2)),
     r"q offsets must have shape \[B, M\] or \[B, M\+1\]"),
    ("offsets_past_end", lambda: call(mask="padding", segments=SD.from_seqlens_and_offsets(
        np.array([[3, 4], [2, -1]]), np.array([[0, 5], [0, -1]]))),
     r"q offsets \+ seqlens must be <= the sequence length 8, got 9"),
    # bias, sink, softmax, scale, soft cap
    ("bias_rank_3", lambda: call(bias=np.zeros((N, T, T), np.float32)),
     r"bias shape \(4, 8, 8\) must be \[B\|1, N\|1, T, S\]"),
    ("bias_batch", lambda: call(bias=np.zeros((3, N, T, T), np.float32)), r"bias shape \(3, 4, 8, 8\)"),
    ("bias_heads", lambda: call(bias=np.zeros((1, K, T, T), np.float32)), r"bias shape \(1, 2, 8, 8\)"),
    ("bias_length", lambda: call(bias=np.zeros((1, 1, T, T + 1), np.float32)), r"bias shape \(1, 1, 8, 9\)"),
    ("bias_int", lambda: call(bias=np.zeros((1, 1, T, T), np.int32)), r"bias must be a floating-point array"),
    ("unknown_softmax", lambda: call(softmax="relu"), r"softmax='relu' must be one of"),
    ("sink_missing", lambda: call(softmax="learnable"), r"softmax='learnable' needs sink"),
    ("sink_shape", lambda: call(softmax="learnable", sink=np.zeros((1, N), np.float32)),
     r"sink shape \(1, 4\) must be \(num_heads,\) = \(4,\)"),
    ("sink_kv_heads", lambda: call(softmax="learnable", sink=np.zeros((K,), np.float32)),
     r"sink shape \(2,\)"),
    ("sink_int", lambda: call(softmax="learnable", sink=np.zeros((N,), np.int32)),
     r"sink must be a floating-point"),
    ("sink_without_learnable", lambda: call(sink=np.zeros((N,), np.float32)),
     r"sink is only used with softmax='learnable'"),
    ("sink_with_off_by_one", lambda: call(softmax="off_by_one", sink=np.zeros((N,), np.float32)),
     r"sink is only used with softmax='learnable', got softmax='off_by_one'"),
    ("scale_inf", lambda: call(scale=float("inf")), r"scale must be a finite"),
    ("scale_string", lambda: call(scale="0.5"), r"scale must be a finite"),
    ("scale_bool", lambda: call(scale=True), r"scale must be a finite real number, got True"),
    ("soft_cap_bool", lambda: call(logits_soft_cap=True),
     r"logits_soft_cap must be a positive finite number or None, got True"),
    ("soft_cap_string", lambda: call(logits_soft_cap="5"), r"logits_soft_cap must be a positive"),
    ("soft_cap_zero", lambda: call(logits_soft_cap=0.0), r"logits_soft_cap must be a positive"),
    ("soft_cap_negative", lambda: call(logits_soft_cap=-1.0), r"logits_soft_cap must be a positive"),
    ("soft_cap_nan", lambda: call(logits_soft_cap=float("nan")), r"logits_soft_cap must be a positive"),
    # cap * tanh(s / cap) is inf * 0 = NaN for an infinite cap: a bad input, not "no cap".
    ("soft_cap_inf", lambda: call(logits_soft_cap=float("inf")), r"logits_soft_cap must be a positive"),
    # dropout
    ("dropout_without_rng", lambda: call(dropout_rate=0.1),
     r"dropout_rate=0.1 while training needs dropout_rng"),
    ("dropout_rate_one", lambda: call(dropout_rate=1.0, dropout_rng=jax.random.key(0)),
     r"dropout_rate must be a real number in \[0, 1\), got 1.0"),
    ("dropout_rate_negative", lambda: call(dropout_rate=-0.1, dropout_rng=jax.random.key(0)),
     r"dropout_rate must be a real number in \[0, 1\)"),
    ("dropout_rate_bool", lambda: call(dropout_rate=True, dropout_rng=jax.random.key(0)),
     r"dropout_rate must be a real number in \[0, 1\), got True"),
    ("dropout_rate_nan", lambda: call(dropout_rate=float("nan"), dropout_rng=jax.random.key(0)),
     r"dropout_rate must be a real number in \[0, 1\), got nan"),
    ("dropout_rng_split", lambda: call(dropout_rate=0.1, dropout_rng=jax.random.split(jax.random.key(0), 4)),
     r"dropout_rng must be a PRNG key: one typed key of shape \(\) .* got dtype key<fry> shape \(4,\)"),
    ("dropout_rng_split_raw", lambda: call(dropout_rate=0.1,
                                           dropout_rng=jax.random.split(jax.random.PRNGKey(0), 4)),
     r"dropout_rng must be a PRNG key: .* uint32 of shape \(2,\), got dtype uint32 shape \(4, 2\)"),
    ("dropout_rng_bool", lambda: call(dropout_rate=0.1, dropout_rng=True), r"dropout_rng must be a PRNG key"),
    # A truthy string would turn dropout off (and "False" is truthy).
    ("deterministic_string", lambda: call(dropout_rate=0.1, dropout_rng=jax.random.key(0),
                                          deterministic="False"),
     r"deterministic must be a bool, got 'False'"),
    ("deterministic_none", lambda: call(deterministic=None), r"deterministic must be a bool, got None"),
    ("return_lse_string", lambda: call(return_lse="yes"), r"return_lse must be a bool, got 'yes'"),
    ("reproducible_int", lambda: call(reproducible=1), r"reproducible must be a bool, got 1"),
    ("dropout_rng_floats", lambda: call(dropout_rate=0.1, dropout_rng=np.zeros(2, np.float32)),
     r"dropout_rng must be a PRNG key"),
    # layouts and implementations
    ("unknown_layout", lambda: call(layout="bhsd"), r"layout='bhsd' must be one of"),
    ("unknown_implementation", lambda: call(implementation="flash"),
     r"implementation='flash' must be one of"),
    ("bs3hd_rank_4", lambda: call(Q, None, None, layout="bs3hd"),
     r"layout='bs3hd' expects q of shape \[B, S, 3, N, H\]"),
    ("bs3hd_two", lambda: call(np.stack([Q, Q], 2), None, None, layout="bs3hd"),
     r"layout='bs3hd' expects q of shape"),
    ("bs3hd_with_k", lambda: call(np.stack([Q] * 3, 2), KV, None, layout="bs3hd"),
     r"layout='bs3hd' packs q, k and v into the first argument"),
    ("bs3hd_missing", lambda: call(None, None, None, layout="bs3hd"), r"layout='bs3hd' expects q of shape"),
    ("bshd_bs2hd_three", lambda: call(Q, np.stack([KV] * 3, 2), None, layout="bshd_bs2hd"),
     r"layout='bshd_bs2hd' expects k of shape \[B, S, 2, K, H\]"),
    ("bshd_bs2hd_with_v", lambda: call(Q, np.stack([KV] * 2, 2), KV, layout="bshd_bs2hd"),
     r"layout='bshd_bs2hd' packs k and v into the second argument"),
    ("bshd_bs2hd_missing_k", lambda: call(Q, None, None, layout="bshd_bs2hd"),
     r"layout='bshd_bs2hd' expects k"),
    ("bshd_missing_v", lambda: call(Q, KV, None), r"layout='bshd' takes separate q, k and v"),
    ("thd_without_segments", lambda: call(layout="thd_thd_thd"),
     r"layout='thd_thd_thd' packs several sequences"),
    ("t3hd_without_segments", lambda: call(np.stack([Q] * 3, 2), None, None, layout="t3hd"),
     r"layout='t3hd' packs several sequences per row and needs segments"),
    # explain validates exactly as attention does
    ("explain_unknown_mask", lambda: flashmesh.explain(Q, KV, KV, mask="foo"), r"mask='foo' must be one of"),
    ("explain_heads", lambda: flashmesh.explain(Q, KV[:, :, :1].repeat(3, 2), KV[:, :, :1].repeat(3, 2)),
     r"num_heads=4 must be a multiple of num_kv_heads=3"),
    # Descriptors whose halves disagree. Found by this suite: they raise TypeError from deep in
    # the mask (broadcasting [2, ...] against [3, ...]) instead of a ValueError (see report).
    ("seqlens_pair_batch", lambda: call(mask="padding", segments=SD.from_seqlens(
        (np.array([3, 4]), np.array([3, 4, 5])))), r"seqlens batch sizes differ"),
    ("offsets_pair_batch", lambda: call(mask="padding", segments=SD.from_seqlens_and_offsets(
        (np.array([[3], [4]]), np.array([[3], [4], [5]])), (np.zeros((2, 1), int), np.zeros((3, 1), int)))),
     r"seqlens batch sizes differ"),
    # Overlapping segments give a token to two segments at once: silently accepted today.
    ("offsets_overlap", lambda: call(mask="padding", segments=SD.from_seqlens_and_offsets(
        np.array([[3, 3], [4, -1]]), np.array([[0, 1], [0, -1]]))), r"q segments overlap"),
]


@pytest.mark.parametrize("make,pattern", [pytest.param(f, p, id=i) for i, f, p in BAD])
def test_bad_input_raises_one_line_value_error(make, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        make()
    message = str(info.value)
    assert "\n" not in message, f"message spans lines: {message!r}"
    assert len(message) < 300, f"message too long: {message!r}"


def test_bad_input_ids_are_unique():
    ids = [i for i, _, _ in BAD]
    assert len(ids) == len(set(ids))


def test_bad_input_under_jit_is_still_a_value_error():
    """Shape errors are found at trace time too."""
    with pytest.raises(ValueError, match=r"num_heads=4 must be a multiple of num_kv_heads=3"):
        jax.jit(lambda q, k: flashmesh.attention(q, k, k))(Q, KV[:, :, :1].repeat(3, 2))


# -- implementations that cannot run a call --------------------------------------------------------
def test_named_cudnn_that_cannot_run_raises_not_implemented_with_reason():
    """float32 is refused by cuDNN on every platform (and on CPU there is no GPU at all)."""
    pattern = r"implementation='cudnn' cannot run this call on \w+: .+"
    with pytest.raises(NotImplementedError, match=pattern) as info:
        call(implementation="cudnn")
    assert "float32" in str(info.value) or "GPU" in str(info.value)


@pytest.fixture
def fake_backend(monkeypatch):
    """A registered implementation that refuses learnable softmax."""
    module = types.ModuleType("fake_attention_backend")
    calls = []

    def unsupported_reason(spec, platform, *, automatic=False):
        return "sinks are not implemented" if spec.softmax == "learnable" else None

    def attention(inputs, spec):
        calls.append(spec)
        from flashmesh.attention import reference
        return reference.attention(inputs, spec)

    module.unsupported_reason, module.attention, module.calls = unsupported_reason, attention, calls
    monkeypatch.setitem(sys.modules, "fake_attention_backend", module)
    impl = registry.Implementation("fake", "fake_attention_backend", "a test double")
    monkeypatch.setitem(registry.IMPLEMENTATIONS, "fake", impl)
    return module


def test_named_implementation_runs_exactly_that_one_or_raises(fake_backend):
    call(implementation="fake")
    assert len(fake_backend.calls) == 1
    with pytest.raises(NotImplementedError, match=r"implementation='fake' cannot run this call on "
                                                  r"\w+: sinks are not implemented"):
        call(implementation="fake", softmax="learnable", sink=np.zeros(N, np.float32))
    assert len(fake_backend.calls) == 1  # refused before running, and nothing else ran instead


def test_explain_lists_every_implementation_with_a_reason(fake_backend):
    sink = np.zeros(N, np.float32)
    ex = flashmesh.explain(Q, KV, KV, softmax="learnable", sink=sink)
    assert [row.name for row in ex.rows] == list(IMPLEMENTATIONS)
    assert ex.reason("fake") == "sinks are not implemented"
    assert ex.reason("reference") is None and "reference" in ex.available()
    assert ex.reason("cudnn")  # float32 and sinks: never runs on cuDNN
    text = str(ex)
    for name in IMPLEMENTATIONS:
        assert name in text
    assert "sinks are not implemented" in text and ex.reason("cudnn") in text
    assert ex.chosen in ex.available()


def test_explain_takes_shapes_and_tells_why_the_reference_is_passed_over():
    """Shapes suffice (nothing is computed); huge logits make the automatic choice skip the
    reference, and explain says so."""
    big = jax.ShapeDtypeStruct((1, 16384, 1, 8), jnp.float32)
    ex = flashmesh.explain(big, big, big, mask="causal")
    assert ex.chosen == "chunked"
    reference = next(row for row in ex.rows if row.name == "reference")
    assert reference.reason is None and "logits" in reference.declines
    assert "not chosen automatically" in str(ex)


def test_explain_names_the_requested_implementation():
    ex = flashmesh.explain(Q, KV, KV, implementation="chunked", return_lse=True)
    assert set(ex.available()) >= {"reference", "chunked"}
    assert ex.chosen == "chunked" and "runs 'chunked' (requested)" in str(ex), str(ex)
    assert "(requested)" not in str(flashmesh.explain(Q, KV, KV))
    refused = flashmesh.explain(Q, KV, KV, implementation="cudnn")
    if refused.reason("cudnn") is not None:  # no GPU: what attention(implementation=) raises
        assert refused.chosen is None and "implementation='cudnn' cannot run" in str(refused)
    with pytest.raises(ValueError, match="implementation"):
        flashmesh.explain(Q, KV, KV, implementation="nope")
