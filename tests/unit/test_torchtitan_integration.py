"""The torchtitan integration's parts, without a job: the CPU shims (dense flex attention against torch's own
flex_attention), RawState (a model's state without its state_dict hooks) and DataPosition (the dataloader's
position as plain data: loaded back, the same batches come again). Skipped where torchtitan is not installed.
The jobs themselves: tests/e2e/test_torchtitan.py."""
from __future__ import annotations

import io
import os

import pytest
import torch

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e .[torchtitan])")

from worker.integrations import torchtitan_cpu  # noqa: E402

torchtitan_cpu.apply()  # before anything imports torchtitan (a no-op if this process did it already)

from worker.integrations.torchtitan import DataPosition, RawState, loads_torchtitan_checkpoint  # noqa: E402

TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "examples", "torchtitan", "tokenizer")


def test_shims_fix_the_device_and_stub_triton_kernels():
    import torchtitan.tools.utils as tt_utils

    assert tt_utils.device_type == "cpu" and tt_utils.device_module.get_device_name() == "cpu"
    if "no_triton_kernels" in torchtitan_cpu.apply():
        from torchtitan.distributed.minimal_async_ep import kernels

        with pytest.raises(RuntimeError, match="need triton"):
            kernels.copy_rows_to_peers_kernel()
    assert set(torchtitan_cpu.apply()) <= set(torchtitan_cpu.SHIM_VERSIONS)


def test_dense_flex_attention_matches_flex_attention_and_has_a_backward():
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    torch.manual_seed(0)
    q = torch.randn(2, 4, 16, 8)
    k, v = torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    doc = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])  # block-causal over two documents in batch 0

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (doc[b, q_idx] == doc[b, kv_idx])

    block_mask = create_block_mask(mask_mod, 2, 1, 16, 16, device="cpu")
    want, want_aux = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
    q.requires_grad_(True)
    got, aux = torchtitan_cpu.dense_flex_attention(q, k, v, score_mod=None, block_mask=block_mask, scale=None,
                                                   enable_gqa=True, return_aux=AuxRequest(lse=True))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(aux.lse, want_aux.lse, atol=1e-5, rtol=1e-5)
    got.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_attention_masks_are_built_without_torch_compile():
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import create_attention_mask, get_causal_mask_mod

    causal = get_causal_mask_mod()
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["frames"]["total"]
    got = create_attention_mask(causal, 2, None, 16, 16, device="cpu")
    assert torch._dynamo.utils.counters["frames"]["total"] == frames  # no frame went through Dynamo
    want = create_block_mask(causal, 2, None, 16, 16, device="cpu")
    assert torch.equal(got.to_dense(), want.to_dense()) and got.mask_mod is causal


class Fused(torch.nn.Module):
    """A module whose state_dict hook renames and copies a parameter, as torchtitan's FusedQKVLinear does."""

    def __init__(self) -> None:
        super().__init__()
        self.wqkv = torch.nn.Parameter(torch.arange(6.0))
        self.register_buffer("count", torch.zeros(()))
        self.register_buffer("cache", torch.ones(3), persistent=False)
        self.register_state_dict_post_hook(self._split)

    @staticmethod
    def _split(module, state, prefix, local_metadata):
        w = state.pop(prefix + "wqkv")
        state[prefix + "wq"], state[prefix + "wk"] = w[:3].clone(), w[3:].clone()


def test_raw_state_reads_and_writes_the_parameters_themselves():
    model = torch.nn.Sequential(Fused())
    raw = RawState(model)
    state = raw.state_dict()
    assert sorted(state) == ["model.0.count", "model.0.wqkv"]  # no hook, no non-persistent buffer
    assert state["model.0.wqkv"].untyped_storage().data_ptr() == model[0].wqkv.untyped_storage().data_ptr()
    raw.load_state_dict({"model.0.wqkv": torch.full((6,), 7.0), "model.0.count": torch.ones(())})
    assert model[0].wqkv.tolist() == [7.0] * 6 and model[0].count.item() == 1.0
    with pytest.raises(KeyError, match="missing keys"):
        raw.load_state_dict({"model.0.wqkv": torch.zeros(6)})
    with pytest.raises(KeyError, match="unknown keys"):
        raw.load_state_dict({"model.0.wq": torch.zeros(3)}, strict=False)
    assert model[0].wqkv.tolist() == [7.0] * 6  # nothing copied after a refusal
    assert [n for n, _ in raw.named_parameters()] == ["model.0.wqkv"]  # the runtime finds the trained parameters


def test_raw_state_goes_through_the_runtime_checkpoints_state_dict_calls():
    """worker.checkpoint saves a managed module with get_model_state_dict and loads it with set_model_state_dict
    (keyword arguments, as nn.Module's): the hooks stay bypassed both ways, the names are named_parameters()'."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = torch.nn.Sequential(Fused())
    raw = RawState(model)
    state = get_model_state_dict(raw)
    assert sorted(state) == ["model.0.count", "model.0.wqkv"]
    set_model_state_dict(raw, {"model.0.wqkv": torch.full((6,), 3.0), "model.0.count": torch.full((), 2.0)})
    assert model[0].wqkv.tolist() == [3.0] * 6 and model[0].count.item() == 2.0


def test_torchtitan_loads_its_checkpoint_only_where_the_runtime_does_not_restore_the_state():
    from tmd.protocol import WorkerRole

    assert loads_torchtitan_checkpoint(WorkerRole.ACTIVE, {})
    assert not loads_torchtitan_checkpoint(WorkerRole.JOINER, {})  # from its leaver or a replica
    assert not loads_torchtitan_checkpoint(WorkerRole.ACTIVE, {"TM_RESUME_FROM": "ckpts"})  # the runtime's wins
    assert loads_torchtitan_checkpoint(WorkerRole.ACTIVE, {"TM_CHECKPOINT_DIR": "ckpts", "TM_CHECKPOINT_EVERY": "5"})


def test_data_position_is_plain_data_and_rewinds_the_loader(tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from examples.torchtitan.make_data import write

    write(str(tmp_path), docs=20)
    tokenizer = HuggingFaceTokenizer.Config().build(tokenizer_path=TOKENIZER)

    def loader():
        return HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=str(tmp_path)).build(
            dp_world_size=2, dp_rank=1, tokenizer=tokenizer, seq_len=16, local_batch_size=2)

    class Trainer:  # what DataPosition uses of torchtitan's Trainer
        def __init__(self):
            self.dataloader = loader()

        def batch_generator(self, data):
            return iter(data)

    first = DataPosition(Trainer())
    for _ in range(3):
        next(first.iterator())
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)  # what a peer would send: loadable without unpickling code
    saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    want = [next(first.iterator())[1] for _ in range(2)]
    first.load_state_dict(saved)  # the same object rewound (a redone step)...
    again = [next(first.iterator())[1] for _ in range(2)]
    other = DataPosition(Trainer())  # ...and a fresh one (a joiner)
    other.load_state_dict(saved)
    joined = [next(other.iterator())[1] for _ in range(2)]
    for batches in (again, joined):
        assert all(torch.equal(a, b) for a, b in zip(batches, want))
    assert not torch.equal(want[0], want[1])
    with pytest.raises(ValueError, match="expected"):
        other.load_state_dict({"json": 1})
    # one string: the structure a planned migration's tail compares stays put while the token buffers change
    from worker.precopy import flatten

    assert flatten(first.state_dict())[1] == flatten(DataPosition(Trainer()).state_dict())[1]
