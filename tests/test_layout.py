"""Layout model: configs, device sets, model specs and shard boxes."""

from math import prod

import numpy as np
import pytest
from conftest import MODELS
from hypothesis import given, settings
from hypothesis import strategies as st

from etc_agent.layout import (
    Device,
    DeviceSet,
    ModelSpec,
    ParallelConfig,
    Shard,
    StateLayout,
    chunk_range,
    flat_range_pieces,
    model_layout,
)

SPECS = {p.stem: ModelSpec.from_yaml(p) for p in sorted(MODELS.glob("*.yaml"))}


def test_shipped_models_are_there():
    assert {"gpt-tiny", "gpt-1.3b", "llama-7b", "llama-13b", "llama-70b"} <= set(SPECS)


@pytest.mark.parametrize(
    "name, billions",
    [("gpt-1.3b", 1.316), ("llama-7b", 6.738), ("llama-13b", 13.016), ("llama-70b", 68.977)],
)
def test_published_parameter_counts(name, billions):
    assert SPECS[name].num_parameters() / 1e9 == pytest.approx(billions, abs=0.001)


def test_parallel_config_parse_and_print():
    cfg = ParallelConfig.parse("tp=4,pp=2,dp=2,zero=1")
    assert (cfg.tp, cfg.pp, cfg.dp, cfg.zero) == (4, 2, 2, 1)
    assert cfg.short() == "tp=4,pp=2,dp=2,zero=1"
    assert ParallelConfig.parse(cfg.short()) == cfg
    assert ParallelConfig.parse("dp=3").short() == "tp=1,pp=1,dp=3,zero=0"
    assert cfg.world_size == 16


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("tp=0", "tp"),
        ("tp=2,zero=1", "zero=1 needs dp > 1"),
        ("tp=x", "not an integer"),
        ("foo=2", "expected items"),
        ("tp=2,tp=4", "twice"),
        ("", "empty"),
        ("zero=2,dp=2", "zero"),
    ],
)
def test_parallel_config_rejects(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        ParallelConfig.parse(text)


def test_rank_order_is_megatron():
    cfg = ParallelConfig(tp=2, pp=3, dp=2)
    assert cfg.rank(pp=1, dp=1, tp=0) == 1 * 4 + 1 * 2 + 0
    for r in range(cfg.world_size):
        assert cfg.rank(*cfg.coord(r)) == r
    assert cfg.tp_groups()[0] == [0, 1]
    assert cfg.dp_groups()[0] == [0, 2]
    assert cfg.pp_groups()[0] == [0, 4, 8]
    for groups in (cfg.tp_groups(), cfg.dp_groups(), cfg.pp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(cfg.world_size))
    with pytest.raises(ValueError, match="needs tp\\*pp\\*dp = 12"):
        cfg.check_world_size(8)


def test_device_sets():
    ds = DeviceSet.parse("n0:2,n1:[0-1,3]")
    assert [str(d) for d in ds] == ["n0:0", "n0:1", "n1:0", "n1:1", "n1:3"]
    assert ds.nodes == ("n0", "n1")
    assert ds.short() == "n0:2,n1:[0-1,3]"
    assert DeviceSet.parse(ds.short()).devices == ds.devices
    assert Device.parse("n1:3") in ds
    for bad in ("n0", "n0:0", "n0:x", "n0:2,n0:[1]", ":3", "n0:[3-1]"):
        with pytest.raises(ValueError):
            DeviceSet.parse(bad)


def test_model_spec_rejects_bad_shapes(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        "name: bad\nnum_layers: 2\nhidden_size: 30\nnum_attention_heads: 4\nffn_hidden_size: 8\nvocab_size: 10\n"
    )
    with pytest.raises(ValueError, match="hidden_size=30 is not a multiple"):
        ModelSpec.from_yaml(path)
    path.write_text("name: bad\nnum_layers: -1\n")
    with pytest.raises(ValueError, match="num_layers"):
        ModelSpec.from_yaml(path)
    with pytest.raises(ValueError, match="not found"):
        ModelSpec.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        SPECS["llama-7b"].check_parallel(ParallelConfig(tp=3))


def test_chunk_range_matches_torch_chunk():
    for size in range(0, 12):
        for parts in range(1, 6):
            sizes = [chunk_range(size, parts, i)[1] for i in range(parts)]
            assert sum(sizes) == size
            import torch

            torch_sizes = [c.numel() for c in torch.arange(size).chunk(parts)] if size else []
            assert [s for s in sizes if s] == torch_sizes


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=4), st.data())
def test_flat_range_pieces_are_contiguous_boxes(lengths, data):
    lengths = tuple(lengths)
    numel = prod(lengths)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    index = np.arange(numel).reshape(lengths)
    seen = []
    for piece in flat_range_pieces(lengths, start, stop):
        block = index[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.lengths))].reshape(-1)
        np.testing.assert_array_equal(block, np.arange(piece.flat_start, piece.flat_start + block.size))
        seen += block.tolist()
    assert seen == list(range(start, stop))
    assert len(flat_range_pieces(lengths, start, stop)) <= 2 * len(lengths) - 1


CONFIGS = [
    "tp=1",
    "tp=2",
    "tp=4,pp=2",
    "tp=2,pp=3,dp=2",
    "tp=2,pp=2,dp=2,zero=1",
    "tp=1,pp=1,dp=3,zero=1",
    "tp=8,pp=4,dp=4,zero=1",
]


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("config", CONFIGS)
def test_layout_state_bytes_match_analytic_count(name, config):
    spec, cfg = SPECS[name], ParallelConfig.parse(config)
    try:
        spec.check_parallel(cfg)
    except ValueError:
        pytest.skip(f"{config} does not shard {name}")
    layout = model_layout(spec, cfg)
    layout.check_complete()
    assert layout.state_bytes() == spec.state_bytes()
    # Per-rank bytes add up to the state plus exactly the replicas.
    assert layout.rank_bytes().sum() >= spec.state_bytes()


def test_tiny_layout_boxes_follow_megatron_conventions():
    spec = SPECS["gpt-tiny"]
    cfg = ParallelConfig.parse("tp=2,pp=2,dp=2,zero=1")
    layout = model_layout(spec, cfg)
    by_key = {s.key: s for s in layout.shards_of(cfg.rank(pp=0, dp=1, tp=1))}
    qkv = by_key["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.offsets == (96, 0) and qkv.lengths == (96, 64) and qkv.flat_range is None
    proj = by_key["decoder.layers.0.self_attention.linear_proj.weight"]
    assert proj.offsets == (0, 32) and proj.lengths == (64, 32)
    assert by_key["decoder.layers.0.self_attention.linear_proj.bias"].lengths == (64,)
    emb = by_key["embedding.word_embeddings.weight"]
    assert emb.offsets == (256, 0) and emb.lengths == (256, 64)
    adam = by_key["optimizer.state.decoder.layers.0.self_attention.linear_qkv.weight.exp_avg"]
    assert adam.offsets == (96, 0) and adam.flat_range == (96 * 64 // 2, 96 * 64)
    assert "decoder.layers.2.input_layernorm.weight" not in by_key  # stage 1 holds layers 2-3
    last = {s.key for s in layout.shards_of(cfg.rank(pp=1, dp=0, tp=0))}
    assert "embedding.word_embeddings.weight" in last  # tied replica on the last stage
    assert "decoder.final_layernorm.weight" in last and "embedding.position_embeddings.weight" not in last


def test_gated_mlp_uses_gate_up_boxes():
    spec = SPECS["llama-7b"]
    layout = model_layout(spec, ParallelConfig(tp=4))
    fc1 = {s.key: s for s in layout.shards_of(1)}["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fc1.global_shape == (2, 11008, 4096)
    assert fc1.offsets == (0, 2752, 0) and fc1.lengths == (2, 2752, 4096)


def test_from_shards_roundtrip_and_errors():
    spec = SPECS["gpt-tiny"]
    cfg = ParallelConfig.parse("tp=2,pp=2,dp=2,zero=1")
    layout = model_layout(spec, cfg)
    shards = [layout.shards_of(r) for r in range(cfg.world_size)]
    again = StateLayout.from_shards(shards)
    assert again.state_bytes() == layout.state_bytes()
    for r in range(cfg.world_size):
        assert again.shards_of(r) == shards[r]
    bad = [list(s) for s in shards]
    s0 = bad[0][0]
    bad[1].append(Shard(s0.key, s0.global_shape, s0.offsets, s0.lengths, "bfloat16"))
    with pytest.raises(ValueError, match="holds bfloat16"):
        StateLayout.from_shards(bad)
    with pytest.raises(ValueError, match="outside size"):
        StateLayout.from_shards([[Shard("w", (4,), (2,), (3,), "float32")]])
    gap = StateLayout.from_shards([[Shard("w", (4,), (0,), (2,), "float32")]])
    with pytest.raises(ValueError, match="2 of 4 elements held by no rank"):
        gap.check_complete()


def test_fsdp_and_hsdp_short_forms_map_onto_dp_and_dp_shard():
    from etc_agent.layout.config import ParallelSpec

    hsdp = ParallelConfig.parse("tp=2,dp_replicate=2,dp_shard=4")
    assert (hsdp.tp, hsdp.dp, hsdp.dp_shard, hsdp.dp_replicate, hsdp.world_size) == (2, 8, 4, 2, 16)
    assert hsdp.short() == "tp=2,pp=1,dp_replicate=2,dp_shard=4"
    assert ParallelConfig.parse(hsdp.short()) == hsdp == ParallelConfig.parse("tp=2,dp=8,dp_shard=4")
    assert ParallelConfig.parse("dp_shard=4").dp == 4  # plain FSDP: every data-parallel rank shards
    assert ParallelConfig.parse("dp=4").short() == "tp=1,pp=1,dp=4,zero=0"  # no FSDP: Megatron's form
    # auto: the shard degree (or else the replicate degree) takes the devices the fixed ones leave
    assert ParallelSpec.parse("tp=2,dp_shard=auto").resolve(14) == ParallelConfig.parse("tp=2,dp_shard=7")
    assert ParallelSpec.parse("dp_replicate=2,dp_shard=auto").resolve(7) == ParallelConfig.parse(
        "dp_replicate=2,dp_shard=3"
    )
    assert ParallelSpec.parse("dp_shard=4").resolve(13) == ParallelConfig.parse("dp_replicate=3,dp_shard=4")
    assert ParallelSpec.parse("dp_shard=4").resolve(3) is None
    assert not ParallelSpec.parse("dp_shard=auto").fully_fixed
    assert ParallelSpec.parse("dp_replicate=2,dp_shard=2").fully_fixed
    assert ParallelSpec.parse("tp=2,pp=2,dp_replicate=2,dp_shard=3").num_devices == 24
    assert ParallelSpec.parse("tp=2,dp=auto").num_devices is None


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("dp=6,dp_shard=4", "does not divide"),
        ("dp_shard=2,zero=1", "FSDP already shards"),
        ("dp=4,dp_replicate=3,dp_shard=2", "is not dp_replicate"),
        ("dp_shard=0", "dp_shard"),
    ],
)
def test_fsdp_configs_that_cannot_be_are_refused(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        ParallelConfig.parse(text)


@pytest.mark.parametrize("config", ["dp_shard=3", "tp=2,dp_shard=4", "tp=2,pp=2,dp_replicate=2,dp_shard=3"])
def test_fsdp_layout_is_fully_shards_dim0_chunks_of_each_tp_box(config):
    """Every rank of a shard group holds ``torch.chunk``'s dim-0 piece of its TP box (a gated FC1 on
    its ffn dim), the replicas hold the same, and each replica group holds the state once."""
    import torch

    spec = SPECS["llama-tiny"]
    cfg = ParallelConfig.parse(config)
    layout = model_layout(spec, cfg)
    tp_layout = model_layout(spec, ParallelConfig(tp=cfg.tp, pp=cfg.pp, dp=cfg.dp))
    for rank in range(cfg.world_size):
        pp, dp, tp = cfg.coord(rank)
        shard = dp % cfg.dp_shard
        tp_boxes = {s.key: s for s in tp_layout.shards_of(rank)}
        mine = layout.shards_of(rank)
        assert sorted(s.key for s in mine) == sorted(tp_boxes)
        for s in mine:
            whole = tp_boxes[s.key]
            dim = 1 if ".linear_fc1." in s.key else 0
            pieces = torch.arange(whole.lengths[dim]).chunk(cfg.dp_shard)
            start, length = (int(pieces[shard][0]), len(pieces[shard])) if shard < len(pieces) else (0, 0)
            if length == 0:
                assert s.lengths[dim] == 0, s
                continue
            assert s.offsets[dim] == whole.offsets[dim] + start and s.lengths[dim] == length, s
            assert all(s.lengths[d] == whole.lengths[d] for d in range(len(s.lengths)) if d != dim), s
    total = sum(s.nbytes for r in range(cfg.world_size) for s in layout.shards_of(r))
    tp_total = sum(s.nbytes for r in range(cfg.world_size) for s in tp_layout.shards_of(r))
    assert total * cfg.dp_shard == tp_total


def test_plans_between_fsdp_layouts_are_valid_and_move_only_what_changes():
    from etc_agent.planner import plan_model_migration

    spec = SPECS["gpt-tiny"]
    four, three = DeviceSet.parse("n0:4"), DeviceSet.parse("n0:3")
    shrink = plan_model_migration(
        spec, ParallelConfig.parse("dp_shard=4"), four, ParallelConfig.parse("dp_shard=3"), three
    )
    new_layout = model_layout(spec, ParallelConfig.parse("dp_shard=3"))
    assert 0 < shrink.bytes_moved < sum(s.nbytes for r in range(3) for s in new_layout.shards_of(r))
    same = plan_model_migration(
        spec,
        ParallelConfig.parse("dp_replicate=2,dp_shard=2"),
        four,
        ParallelConfig.parse("dp_replicate=2,dp_shard=2"),
        four,
    )
    assert same.bytes_moved == 0
    # HSDP losing a device's node: the other replica holds every lost shard
    hsdp = plan_model_migration(
        spec,
        ParallelConfig.parse("dp_replicate=2,dp_shard=2"),
        DeviceSet.parse("n0:2,n1:2"),
        ParallelConfig.parse("dp_shard=2"),
        DeviceSet.parse("n0:2"),
        failed=DeviceSet.parse("n1:2"),
    )
    assert hsdp.bytes_moved == 0
