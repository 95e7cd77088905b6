"""`flashmesh tune`: the candidate grid, the table keys, the table update (the written table
loads, entries are matched by anchor, then key, else appended), and one tiny interpret-mode run
end to end through the CLI."""

import dataclasses
import functools
import json
import re

import pytest

from flashmesh.attention import pallas_mosaic_gpu_common as common
from flashmesh.attention import pallas_mosaic_gpu_sm90_bwd_tiles as bwd_tiles
from flashmesh.attention import pallas_mosaic_gpu_table as config_table
from flashmesh.bench import cli, tune
from flashmesh.bench.shapes import ANCHOR_SHAPES

ANCHORS = {s.name: s for s in ANCHOR_SHAPES}


def test_candidates_are_valid_distinct_and_start_with_todays_config():
    spec = tune.spec_of(ANCHORS["causal_8k_h32_d128"])
    found = tune.candidates(spec)
    assert len(found) == len(set(found)) > 4
    assert found[0] == config_table.heuristic(spec)  # no Hopper here: the table's fallback
    for bs in found:
        assert bs.validate_for(spec) == bs and bs.smem_bytes(spec) <= common.SMEM_BYTES
    assert tune.candidates(spec, limit=3) == found[:3]
    # today's config on a persistent grid, O in its own buffer (Q prefetched) and in Q's, next
    assert found[1:3] == [dataclasses.replace(found[0], persistent=True, reuse_q_for_o=r)
                          for r in (False, True)]
    # the window kernel's config (plain: neither persistent nor overlapped), then persistent
    # with the band a ring and reloaded, and with overlap_heads, next
    swa = tune.candidates(tune.spec_of(ANCHORS["seed000_gqa_swa"]))
    assert isinstance(swa[0], common.WindowBlockSizes) and not swa[0].pingpong
    assert not (swa[0].persistent or swa[0].overlap_heads)
    with_ = functools.partial(dataclasses.replace, swa[0])
    assert swa[1:4] == [with_(persistent=True), with_(persistent=True, reload_band=True),
                        with_(overlap_heads=True)]
    # d64 has room for block_kv 192 with 3 stages, d128 does not without O in Q's buffer
    assert any(bs.block_kv == 192 for bs in tune.candidates(tune.spec_of(ANCHORS["causal_8k_h32_d64"])))


def test_table_keys():
    assert tune.table_key(tune.spec_of(ANCHORS["seed000_gqa_swa"])) == dict(
        qk_dim=128, v_dim=128, mask="window", group=16, max_window=256, min_len=2049, max_len=4096,
        dtypes=["bfloat16", "float16"])
    # a short shape's key does not take the same kind of call at other lengths
    short = tune.table_key(tune.spec_of(ANCHORS["codelab_te_2048"]))
    assert config_table.key_matches(short, tune.spec_of(ANCHORS["codelab_te_2048"]))
    assert not config_table.key_matches(short, tune.spec_of(ANCHORS["causal_8k_h32_d64"]))
    assert tune.table_key(tune.spec_of(ANCHORS["seed000_mla"]))["v_dim"] == 64
    assert tune.table_key(tune.spec_of(ANCHORS["full_4k_h16_d128"]))["mask"] == "none"


def test_the_layer_attention_is_a_named_shape_with_its_own_key():
    """`--shapes guide_layer_attention` tunes the guide layer's attention (B4 T2048, 32 heads of
    128, causal), keyed to its length bucket so the anchors' causal d128 entries stay theirs."""
    shape = tune.named_shapes()["guide_layer_attention"]
    spec = tune.spec_of(shape)
    assert (spec.batch, spec.q_len, spec.num_heads, spec.num_kv_heads, spec.qk_dim, spec.window) == (
        4, 2048, 32, 32, 128, (-1, 0))
    key = tune.table_key(spec)
    assert (key["mask"], key["group"], key["min_len"], key["max_len"]) == ("causal", 1, 1025, 2048)
    assert not config_table.key_matches(key, tune.spec_of(ANCHORS["causal_8k_h32_d128"]))
    assert set(ANCHORS) < set(tune.named_shapes())


def _result(name, config, ms=0.5):
    best = dict(config, pingpong=None, lpt_order=True)
    return dict(shape=name, key=tune.table_key(tune.spec_of(ANCHORS[name])),
                rows=[dict(config=best, compile_s=1.25), {}], best=best, best_ms_back_to_back=ms)


def test_write_table_updates_by_anchor_and_appends(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(config_table.CONFIGS_PATH.read_text())
    before = json.loads(path.read_text())["entries"]
    config = dict(block_q=192, block_kv=64, num_stages=2, num_compute_wgs=3, intra_wg_overlap=False)
    results = [_result("seed000_gqa_swa", config), _result("codelab_te_2048", config, 0.1),
               dict(shape="x", key={}, rows=[], best=None, best_ms_back_to_back=None)]
    meta = dict(date="2026-12-01", device="NVIDIA H200", commit="abc")
    tune.write_table(path, results, meta)
    entries = json.loads(path.read_text())["entries"]
    swa = [e for e in entries if e.get("anchor") == "seed000_gqa_swa"]
    assert len(swa) == 1 and swa[0]["tuned"] is True and swa[0]["config"] == config
    assert "0.5000 ms back to back, best of 2" in swa[0]["source"] and swa[0]["compile_s"] == 1.25
    assert len(entries) in (len(before), len(before) + 1)  # codelab_te_2048: its entry, or a new one
    assert [e for e in entries if e.get("anchor") == "codelab_te_2048"][0]["config"] == config
    # a persistent winner keeps the schedule flags that differ from BlockSizes' defaults
    tune.write_table(path, [_result("full_4k_h16_d128", dict(config, persistent=True,
                                                             reuse_q_for_o=False))], meta)
    full = [e for e in json.loads(path.read_text())["entries"] if e.get("anchor") == "full_4k_h16_d128"]
    assert full[0]["config"] == dict(config, persistent=True, reuse_q_for_o=False)
    assert config_table.forward_config(full[0]["config"]).persistent is True
    # a window-kernel winner keeps its kind
    window = dict(kernel="window", block_kv=64, num_compute_wgs=1)
    tune.write_table(path, [dict(_result("seed000_gqa_swa", {}), best=window)], meta)
    swa = [e for e in json.loads(path.read_text())["entries"] if e.get("anchor") == "seed000_gqa_swa"]
    assert swa[0]["config"] == window
    # and the schedule fields that differ from WindowBlockSizes' defaults (the whole config as
    # `tune_shape` reports it): ping-pong and the Q ring survive into the table
    chosen = common.WindowBlockSizes(pingpong=True, q_buffers=3, q_ahead=1)
    tune.write_table(path, [dict(_result("seed000_gqa_swa", {}), best=config_table.config_fields(chosen))], meta)
    swa = [e for e in json.loads(path.read_text())["entries"] if e.get("anchor") == "seed000_gqa_swa"]
    assert swa[0]["config"] == dict(kernel="window", block_kv=64, num_compute_wgs=2, pingpong=True,
                                    q_buffers=3, q_ahead=1)
    assert config_table.forward_config(swa[0]["config"]) == chosen
    # q_ahead only where it is not its default for the ring (q_buffers - 1)
    deep = common.WindowBlockSizes(q_buffers=4)
    tune.write_table(path, [dict(_result("seed000_gqa_swa", {}), best=config_table.config_fields(deep))], meta)
    swa = [e for e in json.loads(path.read_text())["entries"] if e.get("anchor") == "seed000_gqa_swa"]
    assert swa[0]["config"] == dict(kernel="window", block_kv=64, num_compute_wgs=2, q_buffers=4)
    assert config_table.forward_config(swa[0]["config"]) == deep
    config_table.load_table.cache_clear()


def test_refuses_without_a_hopper_gpu_and_bad_options(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--shapes", "causal_8k_h32_d128", "--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "flashmesh tune: error:" in err and ("Hopper" in err or "NVIDIA GPU" in err)
    with pytest.raises(SystemExit):
        cli.main(["tune", "--shapes", "nope", "--interpret"])
    with pytest.raises(SystemExit):
        cli.main(["tune", "--tiny", "--interpret", "--max-candidates", "0"])


def test_tiny_interpret_run_end_to_end(tmp_path, capsys):
    table = tmp_path / "t.json"
    table.write_text(config_table.CONFIGS_PATH.read_text())
    assert cli.main(["tune", "--interpret", "--tiny", "--max-candidates", "1", "--warmup", "0",
                     "--iters", "1", "--rounds", "1", "--table", str(table), "--out", str(tmp_path),
                     "--no-progress"]) == 0
    folder = next(tmp_path.glob("*-tune"))
    data = json.loads((folder / "results.json").read_text())
    (row,) = data["shapes"][0]["rows"]
    assert row["status"] == "ok" and row["error"] < tune.TOLERANCE, row
    assert "tune_tiny" in (folder / "report.md").read_text()
    assert any(e.get("anchor") == "tune_tiny" and e["tuned"] for e in json.loads(table.read_text())["entries"])
    config_table.load_table.cache_clear()
    # --no-progress: one log line per candidate, numbered against the total
    assert re.search(r"^tune 1/1 \d\d:\d\d:\d\d: tune_tiny: ", capsys.readouterr().out, re.M)


def test_backward_candidates_start_with_todays_config_and_all_fit():
    from flashmesh.bench import tune_backward

    spec = tune.spec_of(tune.TINY)
    found = tune_backward.candidates(spec)
    assert found[0] == bwd_tiles.default_for(spec) and len(found) == len(set(found)) > 4
    assert any(bs.fused_dq and bs.stagger_q for bs in found) and any(not bs.fused_dq for bs in found)
    for bs in found:
        assert bs.validate_for(spec) is bs
    assert tune_backward.candidates(spec, 2) == found[:2]
    # today's config first, then its twin with the other overlap; each two-kernel config with
    # its delta_in_dq twin where that fits (the fused kernel has no dQ kernel)
    assert found[1] == dataclasses.replace(found[0], overlap=not found[0].overlap)
    two = [bs for bs in found if not bs.fused_dq]
    assert two and all(dataclasses.replace(bs, delta_in_dq=not bs.delta_in_dq) in found for bs in two
                       if bs.block_kv_dq == 64)  # 128-key dQ steps leave no room for O's rows
    assert not any(bs.delta_in_dq for bs in found if bs.fused_dq)
    assert not any(bs.dq_columns for bs in found)  # d64: half the columns is no whole swizzle tile
    assert not any(bs.wg_ranges for bs in found)  # causal: wg_ranges saves at most a step a head
    d128_causal = tune_backward.candidates(tune.spec_of(ANCHORS["causal_8k_h32_d128"]))
    swa = tune_backward.candidates(tune.spec_of(ANCHORS["seed000_gqa_swa"]))
    twins = [swa[0]]  # today's config, then each flip of overlap, delta_in_dq, persistent_dq, wg_ranges
    for field in ("overlap", "delta_in_dq", "persistent_dq", "wg_ranges"):
        twins += [dataclasses.replace(c, **{field: not getattr(c, field)}) for c in twins]
    # the fused form on each warpgroup's own tiles, with and without overlap, third and fourth
    fused = [bwd_tiles.BackwardBlockSizes(fused_dq=True, wg_ranges=True, overlap=o) for o in (False, True)]
    assert swa[:18] == twins[:2] + fused + twins[2:]
    assert not any(c.wg_ranges or c.persistent_dq for c in swa[18:])  # today's config's only
    assert not any(c.wg_ranges for c in d128_causal if c.fused_dq)  # no window: no such candidate
    d128 = tune_backward.candidates(tune.spec_of(ANCHORS["full_4k_h16_d128"]))
    # no window: third and fourth the fused form by columns in FA3's order, then without overlap
    columns = bwd_tiles.BackwardBlockSizes(fused_dq=True, dq_columns=True, overlap=True)
    assert d128[2:4] == [columns, dataclasses.replace(columns, overlap=False)] and not d128[0].fused_dq
    assert any(bs.dq_columns and bs.stagger_q for bs in d128) and any(bs.dq_columns and not bs.stagger_q for bs in d128)
    assert tune_backward.config_fields(bwd_tiles.BackwardBlockSizes(block_q=128, fused_dq=True)) == {
        "block_q": 128, "fused_dq": True}


def test_tiny_interpret_backward_run_writes_backward_entries(tmp_path):
    table = tmp_path / "t.json"
    table.write_text(config_table.CONFIGS_PATH.read_text())
    assert cli.main(["tune", "--backward", "--interpret", "--tiny", "--max-candidates", "1", "--warmup", "0",
                     "--iters", "1", "--rounds", "1", "--table", str(table), "--out", str(tmp_path),
                     "--no-progress"]) == 0
    data = json.loads(next(tmp_path.glob("*-tune")).joinpath("results.json").read_text())
    (row,) = data["shapes"][0]["rows"]
    assert data["meta"]["kernel"] == "backward" and row["status"] == "ok" and row["error"] < tune.TOLERANCE, row
    written = json.loads(table.read_text())
    # the tiny shape's key (d64 causal, its group size, the dtypes) is no entry's yet: appended
    (entry,) = [e for e in written["backward_entries"] if e["key"] == data["shapes"][0]["key"]]
    assert entry["tuned"] and entry["source"].startswith("flashmesh tune --backward")
    assert entry["key"]["group"] == tune.spec_of(tune.TINY).group_size
    assert len(written["backward_entries"]) == len(config_table.load_table()["backward_entries"]) + 1
    assert written["entries"] == json.loads(config_table.CONFIGS_PATH.read_text())["entries"]  # forward untouched
    config_table.load_table.cache_clear()


def test_backward_entries_of_shapes_differing_in_group_stay_apart():
    """causal_8k_h32_d128 and gqa_causal_16k (group 8) share head dims and mask: each keeps its
    own entry (2026-12-02 the second overwrote the first's)."""
    from flashmesh.bench import tune_backward

    table = {"backward_entries": []}
    results = [dict(shape=name, key=tune.table_key(tune.spec_of(ANCHORS[name])), rows=[{}],
                    best=best, best_ms_back_to_back=1.0, default_ms_back_to_back=1.0)
               for name, best in (("causal_8k_h32_d128", {"block_kv_dq": 128}), ("gqa_causal_16k", {}))]
    tune_backward.write_entries(table, results, dict(date="2026-12-02", device="NVIDIA H200", commit="abc"))
    by_anchor = {e["anchor"]: e for e in table["backward_entries"]}
    assert set(by_anchor) == {"causal_8k_h32_d128", "gqa_causal_16k"}
    assert by_anchor["causal_8k_h32_d128"]["config"] == {"block_kv_dq": 128}
    assert by_anchor["gqa_causal_16k"]["key"]["group"] == 8 and by_anchor["gqa_causal_16k"]["config"] == {}


def test_backward_write_keeps_hand_written_keys_and_skips_a_shared_key():
    """codelab_small's entry keeps its max_len; codelab_te_2048 (d64 causal, group 1) gets an
    entry of its own length bucket beside causal_8k_h32_d64's; a second result with a key the
    run already wrote is warned about and not written (it would shadow the first)."""
    from flashmesh.bench import tune_backward

    table = json.loads(config_table.CONFIGS_PATH.read_text(encoding="utf-8"))
    before = {e.get("anchor"): e["key"] for e in table["backward_entries"]}
    results = [dict(shape=name, key=tune.table_key(tune.spec_of(ANCHORS[name])), rows=[{}],
                    best={"num_stages": 3}, best_ms_back_to_back=1.0, default_ms_back_to_back=1.0)
               for name in ("codelab_small", "causal_8k_h32_d64", "codelab_te_2048")]
    results.append(dict(results[1], shape="causal_8k_h32_d64_again", best={"num_stages": 1}))
    with pytest.warns(UserWarning, match="causal_8k_h32_d64_again has the table key of causal_8k_h32_d64"):
        tune_backward.write_entries(table, results, dict(date="d", device="H200", commit="abc"))
    after = {e.get("anchor"): e for e in table["backward_entries"]}
    assert after["codelab_small"]["key"] == before["codelab_small"] and "max_len" in before["codelab_small"]
    assert after["causal_8k_h32_d64"]["key"] == before["causal_8k_h32_d64"]
    assert after["causal_8k_h32_d64"]["config"] == {"num_stages": 3}
    assert "causal_8k_h32_d64_again" not in after
    short = after["codelab_te_2048"]["key"]
    assert short["max_len"] == 2048 and not config_table.key_matches(short, tune.spec_of(ANCHORS["causal_8k_h32_d64"]))
