"""Fast tests of the example workload (GPT, Shakespeare stream, state hash) and the cold-restart baseline.

None of these import the TrainMover runtime (``worker``); ``examples/train_gpt.py`` is run once under a
minimal stand-in for it (a gloo world of one) in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from examples.data import TINY_TEXT, ShakespeareStream, load_corpus
from examples.gpt import GPT, GPTConfig, loss
from examples.state_hash import final_state_hash

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(REPO_ROOT, "examples")

torch.set_num_threads(1)


def _subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _tiny_model_and_optimizer(steps: int = 2) -> tuple[GPT, torch.optim.AdamW]:
    """A tiny GPT + AdamW after ``steps`` training steps on rank 0's stream (seed 0)."""
    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    data = ShakespeareStream(0, batch_size=4, context=cfg.context, seed=0)
    for step in range(steps):
        x, y = data.batch(step)
        opt.zero_grad(set_to_none=True)
        loss(model(x), y).backward()
        opt.step()
    return model, opt


# ----------------------------------------------------------------------------------------------------------
# Data stream
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_corpus_is_all_plays():
    corpus = load_corpus()
    assert corpus.dtype == torch.uint8 and corpus.dim() == 1
    assert corpus.numel() > 9_000_000
    assert load_corpus() is corpus  # cached once per process
    assert b"ROMEO" in bytes(corpus.numpy())  # the real plays, not a stand-in


@pytest.mark.timeout(30)
def test_stream_is_deterministic_per_rank_and_step():
    a = ShakespeareStream(1, batch_size=8, context=128, seed=0)
    b = ShakespeareStream(1, batch_size=8, context=128, seed=0)
    x, y = a.batch(3)
    assert x.shape == y.shape == (8, 128) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one byte
    assert int(x.min()) >= 0 and int(x.max()) < 256
    # Same (seed, rank, step) -> same batch, whatever was served before.
    for s in (0, 1, 2):
        b.batch(s)
    assert all(torch.equal(u, v) for u, v in zip(b.batch(3), (x, y)))
    assert torch.equal(a.batch(3)[0], x)  # and again on the same stream
    # Another step, rank or seed -> another batch.
    assert not torch.equal(a.batch(4)[0], x)
    assert not torch.equal(ShakespeareStream(2, seed=0).batch(3)[0], x)
    assert not torch.equal(ShakespeareStream(1, seed=1).batch(3)[0], x)


@pytest.mark.timeout(30)
def test_stream_state_dict_round_trips():
    a = ShakespeareStream(3, batch_size=2, context=16, seed=7, text=TINY_TEXT)
    assert a.state_dict() == {"rank": 3, "seed": 7, "next_step": 0}
    for s in range(5):
        a.batch(s)
    state = a.state_dict()
    assert state == {"rank": 3, "seed": 7, "next_step": 5}
    assert all(type(v) is int for v in state.values())
    json.dumps(state)  # plain data

    # A joiner built for another rank takes over rank 3's stream and continues it.
    b = ShakespeareStream(0, batch_size=2, context=16, seed=0, text=TINY_TEXT)
    b.load_state_dict(state)
    assert b.state_dict() == state
    xa, ya = a.batch(a.next_step)
    xb, yb = b.batch(b.next_step)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert a.next_step == b.next_step == 6


# ----------------------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_gpt_forward_shapes():
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    assert model.config == GPTConfig(vocab_size=256, context=128, d_model=256, n_layer=4, n_head=4)
    idx = torch.randint(0, 256, (2, 128))
    logits = model(idx)
    assert logits.shape == (2, 128, 256) and logits.dtype == torch.float32
    assert model(idx[:, :10]).shape == (2, 10, 256)  # shorter sequences work too
    value = loss(logits, idx)
    assert value.dim() == 0 and value.dtype == torch.float32
    assert abs(value.item() - torch.log(torch.tensor(256.0)).item()) < 0.5  # ~uniform at init
    with pytest.raises(ValueError):
        model(torch.zeros(1, 129, dtype=torch.long))

    small = GPT(GPTConfig(d_model=32, n_layer=1, n_head=2, context=16))
    assert small(torch.zeros(3, 16, dtype=torch.long)).shape == (3, 16, 256)


@pytest.mark.timeout(30)
def test_gpt_is_causal_and_seeded():
    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    model = GPT(cfg)
    torch.manual_seed(0)
    assert final_state_hash(GPT(cfg)) == final_state_hash(model)  # same seed -> same weights
    idx = torch.randint(0, 256, (1, cfg.context))
    changed = idx.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    a, b = model(idx), model(changed)
    assert torch.equal(a[:, :-1], b[:, :-1])  # earlier positions cannot see the last token
    assert not torch.equal(a[:, -1], b[:, -1])


# ----------------------------------------------------------------------------------------------------------
# State hash
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_final_state_hash_is_stable():
    model, opt = _tiny_model_and_optimizer()
    h = final_state_hash(model, opt)
    assert len(h) == 64 and int(h, 16) >= 0
    assert final_state_hash(model, opt) == h
    model2, opt2 = _tiny_model_and_optimizer()  # rebuilt from scratch
    assert final_state_hash(model2, opt2) == h

    class Wrapper(torch.nn.Module):  # like DDP: the real model under .module
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    assert final_state_hash(Wrapper(model), opt) == h
    assert final_state_hash(model) != h  # the optimizer state counts


@pytest.mark.timeout(30)
def test_final_state_hash_sees_one_bit():
    model, opt = _tiny_model_and_optimizer()
    h = final_state_hash(model, opt)
    with torch.no_grad():
        p = model.blocks[0].mlp.fc.weight
        p.view(-1).view(torch.int32)[17] ^= 1  # lowest mantissa bit of one element
    assert final_state_hash(model, opt) != h
    with torch.no_grad():
        p.view(-1).view(torch.int32)[17] ^= 1
    assert final_state_hash(model, opt) == h

    state = opt.state[model.ln_f.bias]
    state["exp_avg_sq"].view(torch.int32)[0] ^= 1  # one bit of the optimizer state
    assert final_state_hash(model, opt) != h
    state["exp_avg_sq"].view(torch.int32)[0] ^= 1
    state["step"] += 1  # a 0-dim tensor
    assert final_state_hash(model, opt) != h


@pytest.mark.timeout(60)
def test_batch_and_hash_agree_across_processes():
    model, opt = _tiny_model_and_optimizer()
    x, _ = ShakespeareStream(2, seed=5).batch(11)
    code = textwrap.dedent(
        """
        import hashlib, torch
        torch.set_num_threads(1)
        from tests.e2e.test_examples import _tiny_model_and_optimizer
        from examples.data import ShakespeareStream
        from examples.state_hash import final_state_hash
        x, _ = ShakespeareStream(2, seed=5).batch(11)
        print(hashlib.sha256(x.numpy().tobytes()).hexdigest(), final_state_hash(*_tiny_model_and_optimizer()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=_subprocess_env(), capture_output=True, text=True, timeout=50
    )
    assert out.returncode == 0, out.stderr
    import hashlib

    batch_digest, state_digest = out.stdout.split()
    assert batch_digest == hashlib.sha256(x.numpy().tobytes()).hexdigest()
    assert state_digest == final_state_hash(model, opt)


# ----------------------------------------------------------------------------------------------------------
# train_gpt.py (without the runtime) and the cold-restart baseline
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
def test_train_gpt_arguments():
    from examples.train_gpt import parse_args

    args = parse_args([])
    assert (args.steps, args.batch_size, args.seed, args.tiny, args.log_every) == (40, 8, 0, False, 5)
    assert parse_args(["--tiny"]).batch_size == 4
    assert parse_args(["--tiny", "--batch-size", "2"]).batch_size == 2


@pytest.mark.timeout(150)
def test_cold_restart_tiny_is_bit_identical():
    from benchmarks.cold_restart import run_cold_restart

    r = run_cold_restart(2, 6, 3, tiny=True, verify=True)
    assert r["bit_identical"] is True and r["ranks_agree"] is True
    assert r["state_sha256"] == r["reference_sha256"]
    assert (r["world"], r["steps"], r["restart_at"]) == (2, 6, 3)
    for key in ("median_step_s", "downtime_s", "checkpoint_s", "restart_s", "load_s"):
        assert isinstance(r[key], float) and r[key] >= 0.0, key
    assert r["downtime_s"] > r["restart_s"] > 0.0  # a restart costs at least a process start
