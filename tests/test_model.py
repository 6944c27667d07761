"""The model runtime against transformers: logits and greedy continuations, batched and chunked."""

from __future__ import annotations

import json
import shutil
from typing import cast

import pytest
import torch

from gpu.attention.metadata import SeqChunk
from gpu.config import ModelError
from gpu.loader import load_model
from gpu.model import DecoderLayer
from gpu.runner import ModelRunner
from tests.models import hf_model

PAGE = 4


def run_chunked(
    runner: ModelRunner,
    prompts: list[list[int]],
    chunk_sizes: list[int],
    adapters: list[int] | None = None,
):
    """Feed every prompt through shared batches, ``chunk_sizes[i]`` tokens of prompt i per step
    (on LoRA slot ``adapters[i]``, if given).

    Returns every position's logits per prompt and each prompt's page table.
    """
    slots = adapters or [0] * len(prompts)
    pages_per_seq = -(-max(len(p) for p in prompts) // PAGE) + 8
    tables = [tuple(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(len(prompts))]
    done = [0] * len(prompts)
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(d < len(p) for d, p in zip(done, prompts)):
        active = [i for i, p in enumerate(prompts) if done[i] < len(p)]
        chunks = [
            SeqChunk(tables[i], done[i], min(chunk_sizes[i], len(prompts[i]) - done[i]), slots[i])
            for i in active
        ]
        out = runner.execute(
            chunks,
            [prompts[i][done[i] : done[i] + c.num_new] for i, c in zip(active, chunks)],
            True,
        )
        row = 0
        for i, c in zip(active, chunks):
            logits[i].append(out[row : row + c.num_new])
            row += c.num_new
            done[i] += c.num_new
    return [torch.cat(x) for x in logits], tables


def greedy_continue(runner, prompts, tables, first_tokens, steps, adapters=None):
    """Batched greedy decode: one token per sequence per step, all sequences in one batch
    (sequence i on LoRA slot ``adapters[i]``, if given)."""
    outputs = [[t] for t in first_tokens]
    lengths = [len(p) for p in prompts]
    slots = adapters or [0] * len(prompts)
    for _ in range(steps - 1):
        chunks = [SeqChunk(tables[i], lengths[i], 1, slots[i]) for i in range(len(prompts))]
        logits = runner.execute(chunks, [[o[-1]] for o in outputs])
        for i, tok in enumerate(logits.argmax(-1).tolist()):
            outputs[i].append(tok)
            lengths[i] += 1
    return outputs


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    rel = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert rel < tol, f"relative error {rel:.2e} >= {tol:.0e}"


@pytest.mark.parametrize(
    ("kind", "kernels"),
    [
        *[("llama", True), ("qwen2", True), ("qwen3", True), ("qwen3", False), ("llama31", True)],
        *[("mixtral", True), ("qwen2_moe", True), ("qwen3_moe", True), ("qwen3_moe", False)],
    ],
    ids=[
        *["llama", "qwen2", "qwen3", "qwen3-torch-ops", "llama31"],
        *["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe-torch-ops"],
    ],
)
def test_batched_chunked_logits_and_greedy_match_transformers(tiny_models, kind, kernels):
    """(``kernels``: the fused CPU kernels, else plain torch ops, what CUDA falls back to.)"""
    folder = tiny_models[kind]
    runner = ModelRunner(load_model(folder, cpu_kernels=kernels), num_pages=256, page_size=PAGE)
    if kernels and runner.model.kernels is not None:  # (a build that fails: its own test's)
        # a mixture of experts runs its one-call kernel (moe.c), not the torch ops
        layers = cast(list[DecoderLayer], list(runner.model.layers))
        assert all(layer.moe.packed() is not None for layer in layers if layer.moe is not None)
    oracle = hf_model(folder)
    prompts = random_prompts(runner.config.vocab_size, [1, 3, 9, 30, 70])
    # chunks smaller than a page (3), equal (4), larger (7, 10), and the whole prompt (100)
    logits, tables = run_chunked(runner, prompts, [3, 4, 7, 10, 100])
    steps = 12
    firsts = [lg[-1].argmax().item() for lg in logits]
    ours = greedy_continue(runner, prompts, tables, firsts, steps)
    for prompt, lg, cont in zip(prompts, logits, ours):
        with torch.no_grad():
            ref = oracle(torch.tensor([prompt])).logits[0]
            gen = oracle.generate(
                torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps
            )[0, len(prompt) :].tolist()
        assert_close(lg, ref, 1e-4)
        assert cont == gen


def test_llama3_rope_scaling_is_applied(tiny_models):
    """The llama31 fixture must really differ from unscaled RoPE, or the test above is moot."""
    from gpu.config import RopeScaling

    model = load_model(tiny_models["llama31"])
    assert model.config.rope_scaling.rope_type == "llama3"
    unscaled = load_model(tiny_models["llama31"])
    object.__setattr__(unscaled.config, "rope_scaling", RopeScaling())
    from gpu.rope import RotaryEmbedding

    unscaled.rope = RotaryEmbedding(unscaled.config, "cpu", torch.float32)
    prompt = random_prompts(512, [60])[0]
    a = ModelRunner(model, 64, PAGE).execute([SeqChunk(tuple(range(64)), 0, 60)], [prompt])
    b = ModelRunner(unscaled, 64, PAGE).execute([SeqChunk(tuple(range(64)), 0, 60)], [prompt])
    assert (a - b).abs().max() > 1e-3


def test_llama3_rope_without_its_original_context_matches_transformers(tiny_models, tmp_path):
    """With original_max_position_embeddings unset, transformers uses the model's
    max_position_embeddings; 8192 was assumed here (logits off by ~0.5, top-1 ~0.92)."""
    folder = tmp_path / "llama31"
    shutil.copytree(tiny_models["llama31"], folder)
    config = json.loads((folder / "config.json").read_text())
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), dict):
            config[key].pop("original_max_position_embeddings", None)
    (folder / "config.json").write_text(json.dumps(config))
    runner = ModelRunner(load_model(folder), num_pages=256, page_size=PAGE)
    prompt = random_prompts(runner.config.vocab_size, [200])[0]
    (logits,), _ = run_chunked(runner, [prompt], [100])
    with torch.no_grad():
        ref = hf_model(folder)(torch.tensor([prompt])).logits[0]
    assert_close(logits, ref, 1e-4)


def test_a_checkpoint_of_quantized_codes_is_refused(tmp_path, tiny_llama):
    """fp8 or int8 weights whose scales sit in other tensors were read as values (logits of
    nothing, top-1 agreement 0); with or without a quantization_config they are refused."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "fp8"
    shutil.copytree(tiny_llama, folder)
    (path,) = folder.glob("*.safetensors")
    weights = load_file(str(path))
    name = "model.layers.0.self_attn.q_proj.weight"
    weights[name] = weights[name].to(torch.float8_e4m3fn)
    save_file(weights, str(path))
    with pytest.raises(ModelError, match=f"{name} is stored as torch.float8_e4m3fn"):
        load_model(folder)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fbgemm_fp8"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="pre-quantized"):
        load_model(folder)


def test_unknown_architecture_is_named(tmp_path, tiny_llama):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unknown architecture 'gpt_neox'"):
        load_model(folder)


def test_missing_weight_files(tmp_path, tiny_llama):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    for f in folder.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        load_model(folder)
    with pytest.raises(ModelError, match="does not exist"):
        load_model(tmp_path / "nowhere")


def test_mismatched_weights(tmp_path, tiny_llama):
    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"mlp.gate_proj.weight has shape \(128, 64\)"):
        load_model(folder)


def test_missing_tensor_is_named(tmp_path, tiny_llama):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny_llama, folder)
    path = next(folder.glob("*.safetensors"))
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path)
    with pytest.raises(ModelError, match="missing tensors: model.layers.1.mlp.up_proj.weight"):
        load_model(folder)


def test_prompt_too_long_and_bad_token_ids(tiny_llama):
    runner = ModelRunner(load_model(tiny_llama), num_pages=128, page_size=PAGE)
    with pytest.raises(ModelError, match="context length is 256"):
        runner.check_prompt([5] * 300)
    with pytest.raises(ModelError, match=r"out of range \[0, 512\): \[512, -1\]"):
        runner.check_prompt([5, 512, -1])
    with pytest.raises(ModelError, match="out of range"):
        runner.execute([SeqChunk((0, 1), 0, 2)], [[3, 9999]])
    with pytest.raises(ModelError, match="exceeds the context length"):
        runner.execute([SeqChunk(tuple(range(128)), 250, 10)], [[3] * 10])
    # the runner is still usable afterwards
    assert runner.execute([SeqChunk((0, 1), 0, 2)], [[3, 4]]).shape == (1, 512)


def test_gguf_and_hf_paths_give_the_same_logits(tmp_path):
    """The same weights written as a GGUF file (llama.cpp layout) and as an HF folder."""
    from gpu.gguf import resolve_model_path
    from tests.models import write_tiny_model
    from tests.test_gguf import write_gguf
    from tests.test_tokenizer import train_byte_level_bpe

    bpe = train_byte_level_bpe()
    orig = write_tiny_model(tmp_path / "orig", "llama", vocab_size=bpe.get_vocab_size())
    gguf_file = write_gguf(orig, tmp_path / "tiny.gguf", bpe)
    via_gguf = ModelRunner(
        load_model(resolve_model_path(str(gguf_file), cache_dir=tmp_path / "cache")), 64, PAGE
    )
    via_hf = ModelRunner(load_model(orig), 64, PAGE)
    prompt = random_prompts(bpe.get_vocab_size(), [23])[0]
    chunk = [SeqChunk(tuple(range(16)), 0, 23)]
    a = via_gguf.execute(chunk, [prompt], all_logits=True)
    b = via_hf.execute(chunk, [prompt], all_logits=True)
    assert torch.equal(a, b)


@pytest.mark.slow
def test_default_smollm2_matches_transformers():
    """The bundled SmolLM2-135M (from its GGUF), batched and chunked, against transformers."""
    from common.tokenizer import Tokenizer
    from gpu.gguf import resolve_model_path

    folder = resolve_model_path(None)
    tok = Tokenizer.from_folder(folder)
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
    prompts = [tok.encode(t) for t in texts]
    prompts.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi!"}])))
    runner = ModelRunner(load_model(folder, progress=False), num_pages=256, page_size=PAGE)
    logits, tables = run_chunked(runner, prompts, [3, 5, 100, 8])
    steps = 8
    firsts = [lg[-1].argmax().item() for lg in logits]
    ours = greedy_continue(runner, prompts, tables, firsts, steps)
    oracle = hf_model(folder)
    oracle.generation_config.eos_token_id = None
    for prompt, lg, cont in zip(prompts, logits, ours):
        with torch.no_grad():
            ref = oracle(torch.tensor([prompt])).logits[0]
            gen = oracle.generate(
                torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert_close(lg, ref, 1e-4)
        assert cont == gen
