"""A generation's training groups formed beside the current default group and installed as torch's
(etc_agent.worker.worldgroups), and a member's state built ahead (etc_agent.worker.member):
processes on gloo, every rank's new rank different from its old one."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta

import pytest
from conftest import make_assignment
from dist_harness import free_port, run_workers

TIMEOUT = timedelta(seconds=30)


def _generation_store(rank: int, world: int, port: int, generation: int):
    """The store a switch forms its groups on: a generation store over a TCPStore, whose waits for
    the peers' addresses keep the switch's bound and end when a newer generation exists."""
    import torch.distributed as dist

    from etc_agent.worker.genstore import GenerationStore

    inner = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=TIMEOUT)
    return GenerationStore(inner, generation, lambda: None, TIMEOUT.total_seconds())


def _form_in_the_stall(rank: int, world: int, port: int, spec: str) -> dict:
    """No default group at all while the groups form (the switch's own path, after the teardown)."""
    import torch
    import torch.distributed as dist

    from etc_agent.layout.config import ParallelConfig
    from etc_agent.worker.groups import release_all_groups
    from etc_agent.worker.worldgroups import form_world

    store = _generation_store(rank, world, port, 3)
    release_all_groups()
    new_rank = world - 1 - rank
    formed = form_world(store, 3, ParallelConfig.parse(spec), new_rank, torch.device("cpu"), TIMEOUT)
    formed.install(TIMEOUT)
    x = torch.ones(1)
    dist.all_reduce(x, group=formed.mesh.get_group("dp"))
    out = {
        "rank": dist.get_rank(),
        "dp": x.item(),
        "dp_ranks": dist.get_process_group_ranks(formed.mesh.get_group("dp")),
    }
    dist.destroy_process_group()
    return out


@pytest.mark.parametrize(
    ("spec", "dp_of"),
    [("dp_replicate=2,dp_shard=2", lambda r: [0, 1, 2, 3]), ("tp=2,dp_shard=2", lambda r: [r % 2, r % 2 + 2])],
    ids=["hsdp", "fsdp-tp"],
)
def test_in_the_stall_with_no_default_group_the_same_groups_form(spec, dp_of):
    results = run_workers(4, _form_in_the_stall, free_port(), spec)
    assert [out["rank"] for out in results] == [3, 2, 1, 0]
    for out in results:
        assert out["dp_ranks"] == dp_of(out["rank"]) and out["dp"] == len(dp_of(out["rank"]))


def _form_beside_training(rank: int, world: int, port: int, spec: str) -> dict:
    import torch
    import torch.distributed as dist

    from etc_agent.layout.config import ParallelConfig
    from etc_agent.worker.context import context_for
    from etc_agent.worker.groups import release_all_groups
    from etc_agent.worker.worldgroups import form_world

    store = _generation_store(rank, world, port, 7)
    config = ParallelConfig.parse(spec)
    new_rank = world - 1 - rank  # the new world numbers its ranks the other way round
    formed: dict = {}

    def form() -> None:
        try:
            formed["world"] = world = form_world(store, 7, config, new_rank, torch.device("cpu"), TIMEOUT)
            with world.as_default():  # what a build ahead slices: this rank's sub-meshes of the new world
                ctx = context_for(config, new_rank, 7, torch.device("cpu"), world.mesh, timeout=TIMEOUT)
                formed["ahead"] = {
                    "rank": dist.get_rank(),
                    "tp": ctx.mesh["tp"].mesh.tolist(),
                    "fsdp": ctx.fsdp_mesh.mesh.tolist(),
                    "dp_rank": dist.get_rank(ctx.dp_group),
                    "dp_size": dist.get_world_size(ctx.dp_group),
                }
        except BaseException as err:  # noqa: BLE001 - raised again in the process's main thread
            formed["error"] = err

    thread = threading.Thread(target=form)
    thread.start()
    for _ in range(20):  # the old generation trains on meanwhile (as many steps on every rank)
        x = torch.ones(1)
        dist.all_reduce(x)
        assert x.item() == world
    thread.join()
    if "error" in formed:
        raise formed["error"]
    world_groups = formed["world"]
    release_all_groups()
    world_groups.install(TIMEOUT)
    ctx = context_for(config, new_rank, 7, torch.device("cpu"), world_groups.mesh, timeout=TIMEOUT)
    out: dict = {"rank": dist.get_rank(), "world": dist.get_world_size(), "groups": {}, "sums": {}}
    out["ahead"] = formed["ahead"]
    out["after"] = {
        "tp": ctx.mesh["tp"].mesh.tolist(),
        "fsdp": ctx.fsdp_mesh.mesh.tolist(),
        "dp_rank": dist.get_rank(ctx.dp_group),
        "dp_size": dist.get_world_size(ctx.dp_group),
    }
    values = torch.arange(4, dtype=torch.float64) + 10 * new_rank
    total = values.clone()
    dist.all_reduce(total)
    out["sums"]["world"] = total.tolist()
    for name in world_groups.dims:
        group = ctx.mesh.get_group(name)
        out["groups"][name] = dist.get_process_group_ranks(group)
        part = values.clone()
        dist.all_reduce(part, group=group)
        out["sums"][name] = part.tolist()
    if config.dp_shard > 1:
        out["fsdp_mesh"] = list(ctx.fsdp_mesh.shape)
    later = dist.new_group(list(range(world)))  # torch's own groups still form after the install
    x = torch.ones(1)
    dist.all_reduce(x, group=later)
    out["later"] = x.item()
    dist.destroy_process_group()
    return out


def _expected_sum(members: list[int]) -> list[float]:
    return [float(sum(i + 10 * r for r in members)) for i in range(4)]


@pytest.mark.parametrize(
    ("spec", "dims"),
    [
        (
            "tp=2,pp=1,dp=2",
            {"pp": lambda r: [r], "dp": lambda r: [r % 2, r % 2 + 2], "tp": lambda r: [r // 2 * 2, r // 2 * 2 + 1]},
        ),
        (
            "dp_replicate=2,dp_shard=2",
            {
                "pp": lambda r: [r],
                "dp_replicate": lambda r: [r % 2, r % 2 + 2],
                "dp_shard": lambda r: [r // 2 * 2, r // 2 * 2 + 1],
                "tp": lambda r: [r],
                "dp": lambda r: [0, 1, 2, 3],
            },
        ),
    ],
    ids=["tp-dp", "hsdp"],
)
def test_a_generations_groups_form_while_the_old_world_trains_and_install_as_torchs(spec, dims):
    results = run_workers(4, _form_beside_training, free_port(), spec)
    for old_rank, out in enumerate(results):
        new_rank = 3 - old_rank
        assert out["rank"] == new_rank and out["world"] == 4
        assert out["sums"]["world"] == _expected_sum([0, 1, 2, 3])
        assert set(out["groups"]) == set(dims)
        for name, members_of in dims.items():
            assert out["groups"][name] == members_of(new_rank), (name, out["groups"])
            assert out["sums"][name] == _expected_sum(members_of(new_rank)), name
        assert out["later"] == 4.0
        # Sliced beside the old world (whose rank for this process differs), the sub-meshes are this
        # rank's in the new one: the same as after the install.
        assert out["ahead"]["rank"] == new_rank
        assert out["ahead"]["tp"] == out["after"]["tp"] == dims["tp"](new_rank)
        assert out["ahead"]["fsdp"] == out["after"]["fsdp"]
        assert (out["ahead"]["dp_rank"], out["ahead"]["dp_size"]) == (out["after"]["dp_rank"], out["after"]["dp_size"])
        assert out["after"]["dp_rank"] == dims["dp"](new_rank).index(new_rank)
        if "dp_shard" in dims:
            assert out["fsdp_mesh"] == [2, 2]


@dataclass
class _View:
    """What prepare_member reads of the job (JobView's fields it uses)."""

    backend: str
    build_ahead: bool
    current: object = None
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        import torch

        from etc_agent.layout.config import ParallelConfig

        self.device = torch.device("cpu")
        self.fail = False
        self.built: list[object] = []
        self.config_for = lambda parallel, world: ParallelConfig.parse(parallel)

    def training_ctx(self):
        return self.current

    def held_tensors(self):
        import torch

        return {"kept": torch.full((1024,), 3.0)}

    def build(self, ctx):
        from etc_agent.worker.member import BuiltState

        if self.fail:
            raise ValueError("tp=3 must divide heads (4)")
        self.built.append(ctx.config.short())
        import torch

        # "kept" has the box of a held tensor (the migration takes its storage over): not touched.
        tensors = {"new": torch.full((4096,), 7.0), "kept": torch.full((1024,), 7.0)}
        return BuiltState({"n": ctx.rank, **tensors}, tensors, True)

    def take_built(self, built) -> None:
        self.taken = built


def _decisions(rank: int, world: int, port: int) -> dict:
    import torch.distributed as dist

    from etc_agent.protocol.control import Assignment
    from etc_agent.worker.member import prepare_member

    dist.destroy_process_group()  # groups of size one on a store of its own
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=TIMEOUT)

    def assignment(generation: int, parallel: str, member: bool = True, trained: bool = True) -> Assignment:
        return make_assignment(
            generation=generation, rank=0 if member else None, parallel=parallel, store_port=port, trained=trained
        )

    out: dict = {}
    view = _View("nccl", True)
    out["nccl"] = prepare_member(view, store, assignment(1, "tp=1,pp=1,dp=1"))  # type: ignore[arg-type]
    view = _View("gloo", True)
    out["sender"] = prepare_member(view, store, assignment(2, "tp=1,pp=1,dp=1", member=False))  # type: ignore[arg-type]
    member = prepare_member(view, store, assignment(3, "tp=1,pp=1,dp=1"))  # type: ignore[arg-type]
    assert member is not None
    out["built"] = member.built is not None and view.built == ["tp=1,pp=1,dp=1,zero=0"]
    assert member.built is not None
    out["touched"] = member.bytes_touched
    new, kept = member.built.tensors["new"], member.built.tensors["kept"]
    out["new_pages"] = (new[::1024].tolist(), sorted(set(new.tolist())))
    out["kept"] = sorted(set(kept.tolist()))
    fresh = prepare_member(view, store, assignment(4, "tp=1,pp=1,dp=1", trained=False))  # type: ignore[arg-type]
    out["fresh_built"] = fresh is not None and fresh.built is not None
    view.current = member.ctx  # training in an equal mesh: the build waits for the switch
    same = prepare_member(view, store, assignment(5, "tp=1,pp=1,dp=1"))  # type: ignore[arg-type]
    out["same_mesh_built"] = same is not None and same.built is not None
    off = prepare_member(_View("gloo", False), store, assignment(6, "tp=1,pp=1,dp=1"))  # type: ignore[arg-type]
    out["off_built"] = off is not None and off.built is not None
    failing = _View("gloo", True)
    failing.fail = True
    broken = prepare_member(failing, store, assignment(7, "tp=1,pp=1,dp=1"))  # type: ignore[arg-type]
    assert broken is not None and broken.built is None
    try:
        broken.take_state(failing)  # type: ignore[arg-type]
        out["raised"] = None
    except ValueError as err:
        out["raised"] = str(err)
    for prepared in (member, fresh, same, off, broken):
        assert prepared is not None
        prepared.discard()
    return out


def test_a_member_is_built_ahead_only_where_the_job_and_the_generation_allow_it():
    [out] = run_workers(1, _decisions, free_port())
    assert out["nccl"] is None  # NCCL forms its groups through init_process_group, in the switch
    assert out["sender"] is None  # a sender has no training groups
    assert out["built"] is True
    # One element per 4 KiB page of the new shard written ahead (the migration overwrites them all).
    assert out["touched"] == 4096 * 4 and out["new_pages"] == ([0.0] * 4, [0.0, 7.0]) and out["kept"] == [7.0]
    assert out["fresh_built"] is False  # nothing to migrate into: build(ctx) initialises, in the switch
    assert out["same_mesh_built"] is False
    assert out["off_built"] is False  # the job did not allow it (job.start(build) without build_ahead)
    assert out["raised"] == "tp=3 must divide heads (4)"  # raised in the switch, where the build would have run


def test_pages_made_resident_in_the_background_skip_held_shards_and_end_before_the_data_phase():
    import torch

    from etc_agent.worker.member import ResidentPages

    new = {"new": torch.full((4096,), 7.0), "kept": torch.full((1024,), 7.0)}
    pages = ResidentPages(new, {"kept": torch.full((1024,), 3.0)}, 60.0)
    assert pages.wait() == 4096 * 4  # one element per 4 KiB page of "new"; "kept" is taken over, not touched
    assert new["new"][::1024].tolist() == [0.0] * 4 and sorted(set(new["new"].tolist())) == [0.0, 7.0]
    assert sorted(set(new["kept"].tolist())) == [7.0]
    assert ResidentPages({"odd": torch.full((8, 8), 1.0).t()}, None, 60.0).wait() == 0  # strided: left alone
