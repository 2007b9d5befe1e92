"""The megatron backend with megatron-core itself, on CPU (a gloo process group of one):
the TransformerConfig it builds, GPTModel logits against the HF model's, one training step
against the torch learner's, HF-named tensors out, checkpoints, and its refusals.

megatron-core names "cuda" in a few places a CPU run reaches, whose numerics do not depend
on the device; ``megatron/on_cpu.py`` points them at the CPU (the ``on_cpu`` fixture
installs it first); everything else is the real code the GPU runs
(tools/bench/megatron_check.py runs the same comparison there).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install 'rlfleet[megatron]'")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

from rlfleet.common.spec.job import load_spec, parse_spec  # noqa: E402
from rlfleet.common.spec.seams import TRAINER_BACKENDS  # noqa: E402
from rlfleet.common.wire.arrays import Float32Array, Int32Array  # noqa: E402
from rlfleet.common.wire.messages import ScoredTrajectory, Trajectory, Turn  # noqa: E402
from rlfleet.daemons.trainer.checkpointing import STATE_FILE, CheckpointError  # noqa: E402
from rlfleet.daemons.trainer.learner import Learner  # noqa: E402
from rlfleet.daemons.trainer.megatron import learner as mb  # noqa: E402
from rlfleet.daemons.trainer.megatron import weights as mw  # noqa: E402
from rlfleet.daemons.trainer.megatron.layout import Layout  # noqa: E402
from tests.tiny_qwen2 import save_random_qwen2  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
TINY = REPO / "models" / "tiny-qwen2"


@pytest.fixture(scope="module")
def on_cpu():
    from rlfleet.daemons.trainer.megatron import on_cpu as cpu

    cpu.install()  # what a learner on device "cpu" does itself; idempotent
    yield
    # The learners made a process group of one and megatron's parallel state in this
    # process; later tests (accelerate, TRL) must not find a distributed run.
    mb.release_parallel_state()


@pytest.fixture(scope="module")
def untied_mha(tmp_path_factory) -> Path:
    """A random Qwen2 the shipped one is not: untied head, one key/value head per head."""
    return save_random_qwen2(tmp_path_factory.mktemp("untied") / "model", vocab=40, hidden=32, intermediate=48,
                             max_positions=64, seed=1, num_key_value_heads=4, tie_word_embeddings=False,
                             rope_theta=5e5, bos_token_id=None, eos_token_id=None)


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_the_transformer_config_follows_the_hf_config(on_cpu):
    shape = mw.shape_from_hf(json.loads((TINY / "config.json").read_text()))
    c = mb.transformer_config(shape)
    assert (c.num_layers, c.hidden_size, c.num_attention_heads, c.num_query_groups, c.kv_channels,
            c.ffn_hidden_size) == (3, 96, 4, 2, 24, 384)
    assert (c.normalization, c.layernorm_epsilon, c.gated_linear_unit) == ("RMSNorm", 1e-6, True)
    assert c.activation_func is torch.nn.functional.silu
    assert (c.add_qkv_bias, c.add_bias_linear) == (True, False)
    assert (c.hidden_dropout, c.attention_dropout, c.params_dtype) == (0.0, 0.0, torch.float32)
    assert (c.tensor_model_parallel_size, c.pipeline_model_parallel_size) == (1, 1)


@pytest.mark.parametrize("model", ["tiny", "untied_mha"])
def test_gpt_model_logits_equal_the_hf_models(on_cpu, model, request):
    path = TINY if model == "tiny" else request.getfixturevalue("untied_mha")
    learner = mb.MegatronLearner(path, device="cpu")
    hf = hf_model(path)
    ids = torch.randint(1, learner.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        learner.gpt.eval()
        logits = learner.gpt(input_ids=ids, position_ids=torch.arange(17)[None].expand(3, -1),
                             attention_mask=mb.causal_mask(17, "cpu"))
        reference = hf(input_ids=ids).logits
    assert logits.shape == reference.shape == (3, 17, learner.vocab_size)
    assert float((logits - reference).abs().max()) < 1e-4
    # HF-named tensors out: the HF model's own names and values
    out = learner.state_tensors()
    state = hf.state_dict()
    assert set(out) == set(state)
    assert all(a.dtype == np.float32 for a in out.values())
    assert all(np.array_equal(out[n], state[n].numpy()) for n in state)


def turn_batch() -> list[list[ScoredTrajectory]]:
    """Two groups of three, prompts and completions of different lengths (padding inside
    every micro-batch), behaviour log-probs off-policy enough for some clipping."""
    groups = []
    for p in range(2):
        prompt = [5 + p, 6, 7, 8, 9][:3 + p]
        group = []
        for k in range(3):
            tokens = [10 + k, 11, 12 + p, 13][:2 + k]
            lp = [-2.5 - 0.3 * j for j in range(len(tokens))]
            turn = Turn(prompt_token_ids=Int32Array(prompt), token_ids=Int32Array(tokens),
                        logprobs=Float32Array(lp), weight_version=0, observation="o", action="a")
            traj = Trajectory(trajectory_id=f"p{p}-g{k}", prompt_id=p, group_id=f"p{p}",
                              task="arithmetic", turns=[turn], env_reward=float(k == p))
            group.append(ScoredTrajectory(trajectory=traj, reward=float(k == p)))
        groups.append(group)
    return groups


def torch_logprobs(learner: Learner, ids: torch.Tensor) -> torch.Tensor:
    from rlfleet.daemons.trainer import grpo

    with torch.no_grad():
        return grpo.token_logprobs(learner.model(input_ids=ids).logits, ids)[0]


def test_one_step_matches_the_torch_learner(on_cpu):
    groups = turn_batch()
    ours = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu", micro_batch_tokens=24)
    ref = Learner(TINY, lr=1e-2, seed=0, micro_batch_tokens=24)
    ids = torch.randint(1, 36, (4, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = ours.forward_logprobs(ids)[0]
    # float32: log-probs near -15 carry ~2e-6 per rounding, and the two models sum in
    # different orders (CI once saw 2.1e-5); a wrong weight mapping is off by ~1.
    assert float((before - torch_logprobs(ref, ids)).abs().max()) < 1e-4
    a, b = ours.train_step(groups), ref.train_step(groups)
    assert a["version"] == b["version"] == 1 and a["tokens"] == b["tokens"] == 18
    for key in ("loss", "grad_norm", "ratio_mean", "clip_frac", "approx_kl", "entropy"):
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    with torch.no_grad():
        after = ours.forward_logprobs(ids)[0]
    assert float((after - before).abs().max()) > 1e-3  # the step moved the policy
    assert float((after - torch_logprobs(ref, ids)).abs().max()) < 1e-4
    theirs = ref.state_tensors()
    out = ours.state_tensors()
    assert set(out) == set(theirs)
    assert max(float(np.abs(out[n] - theirs[n]).max()) for n in out) < 1e-5


def test_held_out_evaluation_generates_with_an_hf_copy_of_the_current_weights(on_cpu):
    from rlfleet.daemons.trainer.evaluation import evaluation_off, policy_to_evaluate

    ours = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu")
    spec = load_spec(REPO / "examples" / "arithmetic-megatron.toml")
    assert evaluation_off(spec, ours) is None
    ours.train_step(turn_batch())
    ids = torch.randint(1, 36, (3, 10), generator=torch.Generator().manual_seed(5))
    hf = policy_to_evaluate(ours)
    with torch.no_grad():
        theirs = torch_logprobs(SimpleNamespace(model=hf), ids)
        mine = ours.forward_logprobs(ids)[0]
    assert float((mine - theirs).abs().max()) < 1e-4  # the copy is the stepped policy
    ours.train_step(turn_batch())
    with torch.no_grad():  # refreshed at each call: the same module, the newer weights
        again = torch_logprobs(SimpleNamespace(model=policy_to_evaluate(ours)), ids)
        assert policy_to_evaluate(ours) is hf
        assert float((again - ours.forward_logprobs(ids)[0]).abs().max()) < 1e-4
        assert float((again - theirs).abs().max()) > 1e-4


def test_close_gives_back_the_process_group_and_a_new_learner_makes_it_again(on_cpu):
    import torch.distributed as dist
    from megatron.core import parallel_state

    first = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu")
    assert dist.is_initialized() and parallel_state.model_parallel_is_initialized()
    first.close()
    assert not dist.is_initialized() and not parallel_state.model_parallel_is_initialized()
    second = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu")
    assert dist.is_initialized() and second.train_step(turn_batch())["version"] == 1


def test_checkpoints_are_hf_folders_and_resume_gives_the_same_next_step(on_cpu, tmp_path):
    groups = turn_batch()
    a = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu")
    a.train_step(groups)
    folder = a.save_checkpoint(tmp_path / "ckpt", extra={"step": 1})
    state = json.loads((folder / STATE_FILE).read_text())
    assert (state["version"], state["backend"], state["step"]) == (1, "megatron", 1)
    # any backend or engine loads it as an HF model: the same weights as published
    hf = hf_model(folder).state_dict()
    published = a.state_tensors()
    assert all(np.array_equal(published[n], hf[n].numpy()) for n in hf)
    b = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu")
    assert b.load_checkpoint(folder) == 1
    sa, sb = a.train_step(groups), b.train_step(groups)
    assert sa["loss"] == sb["loss"] and sb["version"] == 2
    ta, tb = a.state_tensors(), b.state_tensors()
    assert all(np.array_equal(ta[n], tb[n]) for n in ta)
    # the torch learner cannot take this optimizer state (other parameter order): it says so
    with pytest.raises(CheckpointError, match="cannot load optimizer.pt"):
        Learner(TINY).load_checkpoint(folder)


def test_an_unreadable_checkpoint_leaves_the_learner_as_it_was(on_cpu, tmp_path):
    a = mb.MegatronLearner(TINY, device="cpu")
    folder = a.save_checkpoint(tmp_path / "ckpt")
    (folder / mb.DISTCP / "metadata.json").write_bytes(b"not json")
    before = a.state_tensors()
    with pytest.raises(CheckpointError, match=f"cannot load {mb.DISTCP}"):
        a.load_checkpoint(folder)
    assert a.version == 0
    after = a.state_tensors()
    assert all(np.array_equal(before[n], after[n]) for n in before)


def test_the_kind_trains_where_its_placement_puts_it(on_cpu):
    from rlfleet.daemons.trainer.backends import megatron_device

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the CPU fallback is for machines without it")
    assert megatron_device({}) == "cpu"  # no GPU visible: the CPU (on_cpu.py), not a refusal
    assert megatron_device({"CUDA_VISIBLE_DEVICES": ""}) == "cpu"  # the job gave this daemon none
    with pytest.raises(RuntimeError, match="given GPU.*torch was built without CUDA"):
        megatron_device({"CUDA_VISIBLE_DEVICES": "0"})  # given one it cannot use: never silently the CPU
    spec = parse_spec({"job": {"name": "m"}, "model": {"path": str(TINY)},
                       "task": {"env": {"kind": "arithmetic"}}, "trainer": {"backend": {"kind": "megatron"}}})
    learner = TRAINER_BACKENDS.build(spec.trainer.backend, spec=spec)
    assert learner.device.type == "cpu" and learner.train_step(turn_batch())["version"] == 1
    with pytest.raises(mb.MegatronUnavailable, match="needs a CUDA GPU"):
        mb.check_device("cuda", Layout())
    with pytest.raises(mb.MegatronUnavailable, match="pipeline_parallel 2: pipeline parallelism is not built"):
        mb.check_device("cpu", Layout(pipeline=2))


def test_data_parallel_ranks_split_the_rows_between_them():
    lengths = [9, 3, 7, 7, 1, 5]
    shares = [mb.rows_of_rank(lengths, 2, r) for r in (0, 1)]
    assert sorted(shares[0] + shares[1]) == list(range(6))  # every row once
    assert all(share == sorted(share) for share in shares)  # in batch order
    # longest first to the lighter rank: 9+5+3 and 7+7+1
    assert [sum(lengths[n] for n in share) for share in shares] == [17, 15]
    assert mb.rows_of_rank(lengths, 1, 0) == list(range(6))
    assert mb.rows_of_rank([4], 2, 1) == []  # a rank may get none: it still joins the step


def test_bf16_trains_with_float32_master_weights_and_resumes_exactly(on_cpu, tmp_path):
    groups = turn_batch()
    full = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu")
    half = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu", precision="bfloat16")
    assert {p.dtype for p in half.gpt.parameters()} == {torch.bfloat16}
    masters = [p for o in half.optimizer.chained_optimizers for g in o.optimizer.param_groups for p in g["params"]]
    assert masters and {p.dtype for p in masters} == {torch.float32}
    a, b = full.train_step(groups), half.train_step(groups)
    # bf16 keeps 8 bits of mantissa: the same step, to bf16's precision
    assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
    assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=5e-2)
    published = half.state_tensors("bfloat16")
    assert all(v.dtype.name == "bfloat16" for v in published.values())
    assert sum(v.nbytes for v in published.values()) * 2 == sum(v.nbytes for v in full.state_tensors().values())
    folder = half.save_checkpoint(tmp_path / "ckpt")
    assert json.loads((folder / STATE_FILE).read_text())["precision"] == "bfloat16"
    again = mb.MegatronLearner(TINY, lr=1e-2, seed=0, device="cpu", precision="bfloat16")
    assert again.load_checkpoint(folder) == 1
    sa, sb = half.train_step(groups), again.train_step(groups)
    assert sa["loss"] == sb["loss"]  # the float32 master weights came back, not their bf16 copies
    ta, tb = half.state_tensors(), again.state_tensors()
    assert all(np.array_equal(ta[n], tb[n]) for n in ta)
    with pytest.raises(ValueError, match="precision 'fp8'"):
        mb.MegatronLearner(TINY, device="cpu", precision="fp8")


def test_a_rank_reads_only_its_slice_of_the_hf_weights():
    from safetensors.torch import load_file

    whole = load_file(str(TINY / "model.safetensors"))
    for rank in (0, 1):
        mine = mb.read_hf_slice(TINY, 2, rank)
        expected = mw.hf_slice(whole, 2, rank)
        assert set(mine) == set(expected) and all(mine[n].equal(expected[n]) for n in mine)
    assert all(t.equal(whole[n]) for n, t in mb.read_hf_slice(TINY).items())
