"""Real module state: a small transformer tensor-parallelised with DTensor, AdamW after one step,
migrated tp=2 -> tp=1,dp=2; the next training step matches an unmigrated reference."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from dist_harness import run_workers

from etc_agent.layout import Device
from etc_agent.migrate import migrate_state

HIDDEN, HEADS, FFN, VOCAB, SEQ = 32, 4, 64, 48, 8
LR = 1e-3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(HIDDEN)
        # No QKV bias: the key bias has an exactly-zero gradient (softmax shift invariance), so Adam
        # would turn round-off noise into full-size updates and no two runs would agree on it.
        self.q = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o = nn.Linear(HIDDEN, HIDDEN)
        self.norm2 = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.norm1(x)
        head_dim = HIDDEN // HEADS
        # -1 heads: under tensor parallelism each rank computes only its own heads.
        q, k, v = (proj(h).view(b, s, -1, head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(attn.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(inputs).reshape(-1, VOCAB), targets.reshape(-1))


def new_adamw_with_state(model: nn.Module) -> torch.optim.AdamW:
    """AdamW whose state already exists in the new shapes (no dummy step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    return opt


def worker(rank: int, world: int) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    # Old layout: tp=2 over both processes.
    torch.manual_seed(0)
    model = TinyTransformer()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = {}
    for i in range(2):
        plan.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc1")})
        plan.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "fc2")})
    parallelize_module(model, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    inputs, targets = batch(0)
    loss_fn(model, inputs, targets).backward()
    opt.step()
    opt.zero_grad()
    model_sd, optim_sd = get_state_dict(model, opt)
    old_state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}

    # New layout: tp=1, dp=2 (each process a full replica), built directly in the new shapes.
    torch.manual_seed(1)  # different init: every value must come from the migration
    new_model = TinyTransformer()
    new_opt = new_adamw_with_state(new_model)
    new_state = {
        "model": dict(new_model.named_parameters()),
        "optim": {"state": {name: new_opt.state[p] for name, p in new_model.named_parameters()}},
    }
    result = migrate_state(old_state, new_state, device=Device("n0", rank), old_rank=rank, new_rank=rank, tp=1)
    # Right after the migration the replica is bitwise the TP state (parameters and Adam moments).
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    for name, p in new_model.named_parameters():
        assert torch.equal(p.detach(), full(model_sd[name])), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(new_opt.state[p][key], full(optim_sd["state"][name][key])), (name, key)
        assert float(new_opt.state[p]["step"]) == 1.0
    del model, opt, model_sd, optim_sd, old_state

    # One more step with dp=2: each replica takes half the batch, gradients averaged.
    inputs, targets = batch(1)
    half = slice(rank * 2, rank * 2 + 2)
    loss_fn(new_model, inputs[half], targets[half]).backward()
    for p in new_model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= world
    new_opt.step()

    # Reference: one process, never migrated, same two steps on the full batches.
    torch.manual_seed(0)
    ref = TinyTransformer()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    for step in range(2):
        inputs, targets = batch(step)
        loss_fn(ref, inputs, targets).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    worst = 0.0
    for (name, p), (_, r) in zip(new_model.named_parameters(), ref.named_parameters()):
        # TP reduces partial sums in another order than one process does: a few ulps, not more.
        torch.testing.assert_close(
            p.detach(), r.detach(), rtol=1e-6, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}"
        )
        worst = max(worst, (p - r).abs().max().item())
        s, rs = new_opt.state[p], ref_opt.state[r]
        torch.testing.assert_close(s["exp_avg"], rs["exp_avg"], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(s["exp_avg_sq"], rs["exp_avg_sq"], rtol=1e-6, atol=1e-6)
        assert float(s["step"]) == float(rs["step"]) == 2.0
    return {"worst": worst, "moved": result.metrics.bytes_moved_total, "local": result.metrics.bytes_copied_locally}


def test_dtensor_tp2_to_dp2_then_step_matches_reference():
    results = run_workers(2, worker, timeout_s=180)
    assert all(r["worst"] <= 1e-5 for r in results)
    # Each replica needs the other half of every TP-split tensor: something moved, something stayed.
    assert results[0]["moved"] > 0 and all(r["local"] > 0 for r in results)
