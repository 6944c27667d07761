"""LoRA adapters (vLLM's --lora-modules): several in one step beside the base model, each
request's logits and greedy text those of transformers with its adapter merged in."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from common.config import parse_lora_modules
from common.page_hash import namespace_root, page_hashes
from common.wire.executor import TokenizedRequest
from gpu.attention.metadata import SeqChunk
from gpu.config import ModelError
from gpu.loader import load_model
from gpu.lora import AdapterBusy, LoraSet, UnknownAdapter, load_adapter
from gpu.runner import ModelRunner
from tests.models import hf_model, merged_hf_model, write_tiny_lora
from tests.test_model import PAGE, greedy_continue, run_chunked


@pytest.fixture(scope="module")
def adapters(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    """Per base kind: an adapter of q and v only (rank 4), and one of every projection (rank
    8, rsLoRA)."""
    root = tmp_path_factory.mktemp("loras")
    out = {}
    for kind in ("llama", "qwen3"):
        base = tiny_models[kind]
        out[kind] = (
            write_tiny_lora(root / f"{kind}-qv", base, ("q_proj", "v_proj"), rank=4, seed=1),
            write_tiny_lora(root / f"{kind}-all", base, rank=8, alpha=4.0, seed=2, use_rslora=True),
        )
    return out


def greedy(oracle: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``, ``n`` tokens exactly."""
    with torch.no_grad():
        out = oracle.generate(
            torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.fixture(scope="module")
def llama_oracles(tiny_llama: Path, adapters) -> dict[str, Any]:
    """transformers' model per LoRA name ("": the base), each adapter merged in."""
    qv, everything = adapters["llama"]
    return {
        "": hf_model(tiny_llama),
        "qv": merged_hf_model(tiny_llama, qv),
        "all": merged_hf_model(tiny_llama, everything),
    }


def both_adapters(model: Any, pair: tuple[Path, Path]) -> LoraSet:
    """``pair``'s adapters as "qv" (slot 1) and "all" (slot 2)."""
    qv, everything = pair
    return LoraSet(
        [load_adapter("qv", qv, model.config), load_adapter("all", everything, model.config)]
    )


def run_all(engine: Any) -> dict[str, list[int]]:
    """Step ``engine`` until every request ends: each one's tokens."""
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    return outputs


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_a_step_mixing_adapters_and_the_base_matches_each_merged_model(
    tiny_models, adapters, kind, kernels
):
    base = tiny_models[kind]
    qv, everything = adapters[kind]
    model = load_model(base, progress=False, cpu_kernels=kernels)
    runner = ModelRunner(model, num_pages=128, page_size=PAGE)
    runner.load_loras(both_adapters(model, adapters[kind]))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 9, 7, 11)]
    slots = [0, 1, 2, 1]  # the base, both adapters, one of them twice
    steps = 6
    # chunked prefill, 3 tokens a step, then greedy decode: every sequence in every step
    logits, tables = run_chunked(runner, prompts, [3] * len(prompts), slots)
    firsts = [int(lg[-1].argmax()) for lg in logits]
    decoded = greedy_continue(runner, prompts, tables, firsts, steps, slots)
    oracles = {
        0: hf_model(base),
        1: merged_hf_model(base, qv),
        2: merged_hf_model(base, everything),
    }
    for prompt, slot, lg, tokens in zip(prompts, slots, logits, decoded, strict=True):
        oracle = oracles[slot]
        with torch.no_grad():
            ref = oracle(torch.tensor([prompt])).logits[0]
        rel = float((lg - ref).abs().max() / ref.abs().max())
        assert rel < 1e-4, (slot, rel)
        assert tokens == greedy(oracle, prompt, steps), slot
    # the adapters change the output (or the comparison above proves nothing)
    assert len({tuple(t) for t in (decoded[0], decoded[1], decoded[2])}) == 3


def test_the_fused_decode_step_is_not_taken_with_adapter_rows(tiny_llama, adapters):
    model = load_model(tiny_llama, progress=False)
    assert model.fused_decoder() is not None
    calls: list[int] = []
    real = model.fused_decoder

    def counted() -> object:
        calls.append(1)
        return real()

    model.fused_decoder = counted  # type: ignore[method-assign,assignment]
    runner = ModelRunner(model, num_pages=16, page_size=PAGE)
    runner.load_loras(LoraSet([load_adapter("qv", adapters["llama"][0], model.config)]))
    runner.execute([SeqChunk((0, 1), 0, 5, 1)], [[5, 6, 7, 8, 9]])
    runner.execute([SeqChunk((0, 1), 5, 1, 1)], [[10]])
    assert calls == []
    runner.execute([SeqChunk((2, 3), 0, 5)], [[5, 6, 7, 8, 9]])
    runner.execute([SeqChunk((2, 3), 5, 1)], [[10]])
    assert calls == [1]
    with pytest.raises(ValueError, match="LoRA slot"):
        runner.execute([SeqChunk((2, 3), 6, 1, 2)], [[10]])


def test_peft_names_with_the_adapter_name_load_alike(tiny_llama, tmp_path) -> None:
    """Some peft versions save ``...lora_A.default.weight``: the same adapter."""
    from safetensors.torch import load_file, save_file

    config = load_model(tiny_llama, progress=False).config
    folder = write_tiny_lora(tmp_path / "a", tiny_llama, ("q_proj", "down_proj"))
    plain = load_adapter("a", folder, config)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    renamed = {n.replace(".weight", ".default.weight"): t for n, t in tensors.items()}
    save_file(renamed, str(folder / "adapter_model.safetensors"))
    named = load_adapter("a", folder, config)
    for mine, theirs in zip(plain.layers, named.layers, strict=True):
        assert mine.keys() == theirs.keys() == {"qkv", "down"}
        for key in mine:
            assert torch.equal(mine[key].a, theirs[key].a)
            assert torch.equal(mine[key].b, theirs[key].b)


def test_parse_lora_modules() -> None:
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    for bad in (["a"], ["=x"], ["a="], ["a=x", "a=y"]):
        with pytest.raises(ValueError):
            parse_lora_modules(bad)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "use_dora"),
        ({"bias": "all"}, "bias"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"peft_type": "IA3"}, "peft_type"),
        ({"lora_bias": True}, "lora_bias"),
    ],
)
def test_settings_it_does_not_compute_are_refused(tiny_llama, tmp_path, change, message) -> None:
    folder = write_tiny_lora(tmp_path / "a", tiny_llama, ("q_proj",), **change)
    config = load_model(tiny_llama, progress=False).config
    with pytest.raises(ModelError, match=message):
        load_adapter("a", folder, config)


def test_tensors_it_cannot_place_are_refused(tiny_llama, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    config = load_model(tiny_llama, progress=False).config
    with pytest.raises(ModelError, match="no adapter_config.json"):
        load_adapter("a", tmp_path, config)
    folder = write_tiny_lora(tmp_path / "a", tiny_llama, ("q_proj",))
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    extra = {**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)}
    save_file(extra, str(folder / "adapter_model.safetensors"))
    with pytest.raises(ModelError, match="lm_head"):
        load_adapter("a", folder, config)
    name = next(n for n in tensors if n.endswith("lora_B.weight"))
    # a bias of B (peft's lora_bias) is not a weight it can place: refused, never read as B
    save_file(
        {**tensors, name.replace(".weight", ".bias"): torch.zeros(64)},
        str(folder / "adapter_model.safetensors"),
    )
    with pytest.raises(ModelError, match="lora_B.bias"):
        load_adapter("a", folder, config)
    bad = dict(tensors)
    bad[name] = torch.zeros(3, 4)
    save_file(bad, str(folder / "adapter_model.safetensors"))
    with pytest.raises(ModelError, match="q_proj: lora_A/lora_B must be"):
        load_adapter("a", folder, config)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4}) + "{")
    with pytest.raises(ModelError, match="not valid JSON"):
        load_adapter("a", folder, config)


def test_engine_requests_name_their_adapter_and_cache_their_prefix_apart(
    tiny_llama, adapters, llama_oracles
):
    """The same prompt under the base, adapter "qv", then both again: each output is its own
    model's, and a prefix is served from the cache only to a request of the same adapter
    (pages of the base's KV reused under an adapter would change its output)."""
    from gpu.engine import Engine, EngineConfig
    from gpu.sampling_params import SamplingParams

    qv, _ = adapters["llama"]
    model = load_model(tiny_llama, progress=False)
    runner = ModelRunner(model, 64, PAGE)
    runner.load_loras(LoraSet([load_adapter("qv", qv, model.config)]))
    engine = Engine(runner, EngineConfig(64, 8, True), eos_token_ids=[2])
    prompt = list(range(10, 31))  # 5 full pages
    with pytest.raises(UnknownAdapter, match="`nope` .a LoRA adapter. is not loaded here"):
        engine.add_request("bad", prompt, SamplingParams(max_tokens=2), lora="nope")
    cached: dict[str, int] = {}
    for rid, lora in (("base", ""), ("lora", "qv"), ("base2", ""), ("lora2", "qv")):
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        engine.add_request(rid, prompt, params, lora=lora)
        tokens: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
                cached[rid] = out.cached_tokens
        assert tokens == greedy(llama_oracles[lora], prompt, 6), rid
    assert cached == {"base": 0, "lora": 0, "base2": 20, "lora2": 20}


# --------------------------------------------------------------------------- through the mesh


@pytest.fixture(scope="module")
def lora_mesh(tiny_llama: Path, adapters):
    from tests.mesh import MeshHarness

    qv, everything = adapters["llama"]
    modules = (f"qv={qv}", f"all={everything}")
    harness = MeshHarness(
        tiny_llama,
        executors=2,
        # (the gateway lists one no executor loaded: a deployment whose flags differ)
        gateway_options={"lora_modules": (*modules, "ghost=/nowhere")},
        executor_options={"lora_modules": modules},
    ).start()
    yield harness
    harness.stop()


async def test_a_request_naming_an_adapter_runs_with_it(
    lora_mesh, tiny_llama, adapters, llama_oracles
) -> None:
    """vLLM's way: the adapter is the request's model. The same prompt under the base and each
    adapter, twice each (the second from cached pages: its adapter's), streamed and not: each
    greedy text is transformers' with that adapter merged in; /v1/models lists the adapters."""
    import aiohttp

    from common.tokenizer import Tokenizer
    from tests.mesh import openai_client, runtime_of

    qv, _ = adapters["llama"]
    tok = Tokenizer.from_folder(tiny_llama)
    ids = list(range(40, 90))  # several full pages
    client = openai_client(lora_mesh.base_url)
    texts, cached = {}, []
    for model in ("tiny", "qv", "all", "qv", "tiny", "all"):
        expected = greedy(llama_oracles["" if model == "tiny" else model], ids, 8)
        out = await client.completions.create(
            model=model, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == tok.decode(expected), model
        assert out.model == model
        texts[model] = out.choices[0].text
        details = out.usage.prompt_tokens_details if out.usage else None
        cached.append(details.cached_tokens if details else None)
        stream = await client.completions.create(
            model=model, prompt=ids, max_tokens=8, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert "".join([c.choices[0].text async for c in stream if c.choices]) == texts[model]
    assert len(set(texts.values())) == 3
    # the first of each model computes the prompt (another's pages are not its KV); the
    # second is routed to them and served from them (non-streamed requests: the even ones)
    assert cached[:3] == [0, 0, 0] and all(c and c > 0 for c in cached[3:]), cached
    # the index holds each model's first page at its root, and the tokenizer hashes a
    # request's pages as its executor does (so the kv router finds an adapter's pages)
    assert lora_mesh.index is not None
    tree = lora_mesh.index.tree
    for name in ("", "qv", "all"):
        first = page_hashes(ids, lora_mesh.page_size, namespace_root(name))[0]
        assert first in tree.root.children, name
    seen: list[TokenizedRequest] = []
    tokenizer = runtime_of(lora_mesh.services[0])
    subject = tokenizer.subjects.scheduler_submit

    async def watch(msg: Any) -> None:
        seen.append(TokenizedRequest.decode(msg.data))

    sub = await tokenizer.nc.subscribe(subject, cb=watch)
    await tokenizer.nc.flush()  # (the server has the subscription before the request goes)
    await client.completions.create(model="all", prompt=ids, max_tokens=1)
    await asyncio.sleep(0.2)
    await sub.unsubscribe()
    (request,) = seen
    assert request.lora == "all"
    assert request.page_hashes == page_hashes(ids, lora_mesh.page_size, namespace_root("all"))
    listed = await client.models.list()
    cards = {m.id: m.model_dump() for m in listed.data}
    assert cards["qv"]["parent"] == "tiny" and cards["qv"]["root"] == str(qv)
    assert cards["tiny"]["parent"] is None and set(cards) == {"tiny", "qv", "all", "ghost"}
    async with aiohttp.ClientSession() as session:
        body = {"model": "nope", "prompt": "x", "max_tokens": 1}
        async with session.post(f"{lora_mesh.base_url}/completions", json=body) as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["code"] == "model_not_found"
        # one no executor serves is answered as an unknown model (by the scheduler), not a 400
        body = {"model": "ghost", "prompt": "x", "max_tokens": 1}
        async with session.post(f"{lora_mesh.base_url}/completions", json=body) as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
            assert error["code"] == "model_not_found"
            assert "served by no executor" in error["message"]
    await client.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_engine_steps_mixing_adapters_match_the_merged_models(
    tiny_llama, adapters, llama_oracles, overlap
):
    """Requests on both adapters and the base, joining as others run, in the plain and the
    overlapped step loop (the next step queued before the last one's tokens are read)."""
    from gpu.engine import Engine, EngineConfig
    from gpu.sampling_params import SamplingParams

    model = load_model(tiny_llama, progress=False)
    runner = ModelRunner(model, 128, PAGE)
    runner.load_loras(both_adapters(model, adapters["llama"]))
    engine = Engine(runner, EngineConfig(16, 8, True, overlap_steps=overlap), eos_token_ids=[2])
    assert (engine.overlap is not None) is overlap
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (9, 4, 14, 6, 11)]
    loras = ["all", "", "qv", "all", "qv"]
    outputs: dict[str, list[int]] = {}
    step = 0
    while step == 0 or engine.has_unfinished():
        if step < len(prompts):  # one joins per step
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            engine.add_request(str(step), prompts[step], params, lora=loras[step])
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        assert outputs[str(i)] == greedy(llama_oracles[lora], prompt, 8), (i, lora)


def test_speculative_verification_runs_drafts_with_the_adapter(tiny_llama, adapters, llama_oracles):
    """Prompt lookup drafts for adapter requests beside base ones: the drafts' rows are
    verified on each request's own adapter, so every output is its merged model's greedy
    text, and drafts were taken."""
    from gpu.engine import Engine, EngineConfig
    from gpu.proposers import NgramProposer
    from gpu.sampling_params import SamplingParams

    model = load_model(tiny_llama, progress=False)
    runner = ModelRunner(model, 128, PAGE)
    runner.load_loras(both_adapters(model, adapters["llama"]))
    config = EngineConfig(64, 8, True, num_speculative_tokens=3, adaptive_speculation=False)
    engine = Engine(runner, config, eos_token_ids=[2], proposer=NgramProposer(max_n=3, min_n=1))
    # repetitive prompts, so prompt lookup finds drafts
    prompts = [[7, 8, 9, 10] * 5, [11, 12, 13] * 6, [20, 21] * 9, [7, 8, 9, 10] * 5]
    loras = ["qv", "", "all", "all"]
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        engine.add_request(str(i), prompt, params, lora=lora)
    outputs = run_all(engine)
    for i, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        assert outputs[str(i)] == greedy(llama_oracles[lora], prompt, 10), (i, lora)
    assert engine.spec.num_draft_tokens > 0


@pytest.fixture(scope="module")
def split_mesh(tiny_llama: Path, adapters):
    """Two executors, only the second serving adapter "qv"; the gateway is told of no adapter
    but "ghost" (which nobody serves): it learns "qv" from the executors' heartbeats."""
    from tests.mesh import MeshHarness

    qv, _ = adapters["llama"]
    harness = MeshHarness(
        tiny_llama,
        executors=2,
        gateway_options={"lora_modules": ("ghost=/nowhere",)},
        executor_overrides={1: {"lora_modules": (f"qv={qv}",)}},
    ).start()
    yield harness
    harness.stop()


async def test_adapter_requests_go_only_to_executors_serving_the_adapter(
    split_mesh, tiny_llama, llama_oracles
) -> None:
    """Eight concurrent requests on "qv" (the router would spread them over both executors):
    every one is served, by the executor that has it, with its merged model's text; base
    requests still use both executors. /v1/models lists "qv", learned from the heartbeats;
    an adapter no live executor serves is a 404 from the scheduler, not a wait."""
    import aiohttp

    from common.tokenizer import Tokenizer
    from tests.mesh import openai_client

    tok = Tokenizer.from_folder(tiny_llama)
    client = openai_client(split_mesh.base_url)
    listed = {m.id for m in (await client.models.list()).data}
    assert listed == {"tiny", "qv", "ghost"}
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 512, (12,), generator=g).tolist() for _ in range(8)]

    async def one(prompt: list[int], model: str) -> str:
        out = await client.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        return out.choices[0].text

    before = [ex.engine.pages.queries for ex in split_mesh.executor_services]
    texts = await asyncio.gather(*(one(p, "qv") for p in prompts))
    after = [ex.engine.pages.queries for ex in split_mesh.executor_services]
    assert after[0] == before[0] and after[1] > before[1]  # (prompt tokens looked up)
    for prompt, text in zip(prompts, texts, strict=True):
        assert text == tok.decode(greedy(llama_oracles["qv"], prompt, 6))
    await asyncio.gather(*(one(p, "tiny") for p in prompts))
    base = [ex.engine.pages.queries for ex in split_mesh.executor_services]
    assert base[0] > after[0]  # the base model's requests go to both
    async with aiohttp.ClientSession() as session:
        body = {"model": "ghost", "prompt": "x", "max_tokens": 1}
        async with session.post(f"{split_mesh.base_url}/completions", json=body) as resp:
            assert resp.status == 404
            error = (await resp.json())["error"]
    assert error["code"] == "model_not_found" and "served by no executor" in error["message"]
    await client.close()


@pytest.fixture(scope="module")
def runtime_mesh(tiny_llama: Path):
    from tests.mesh import MeshHarness

    harness = MeshHarness(
        tiny_llama, executors=2, gateway_options={"allow_runtime_lora_updating": True}
    ).start()
    yield harness
    harness.stop()


async def test_adapters_load_and_unload_at_run_time(
    runtime_mesh, lora_mesh, tiny_llama, adapters, llama_oracles
) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, on every executor: the name is
    a model at once (its merged model's text), loading it again changes nothing, a bad folder
    is a 400 naming it, and once unloaded it is an unknown model. Without the flag the routes
    do not exist."""
    import aiohttp

    from common.tokenizer import Tokenizer
    from tests.mesh import openai_client

    qv, _ = adapters["llama"]
    root = runtime_mesh.base_url.removesuffix("/v1")
    client = openai_client(runtime_mesh.base_url)
    prompt = list(range(30, 45))

    async def post(path: str, body: dict[str, Any], base: str = root) -> tuple[int, str]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{base}{path}", json=body) as resp,
        ):
            return resp.status, await resp.text()

    load = {"lora_name": "qv", "lora_path": str(qv)}
    assert await post("/v1/load_lora_adapter", load) == (
        200, "Success: LoRA adapter 'qv' added successfully."
    )  # fmt: skip
    assert {m.id for m in (await client.models.list()).data} == {"tiny", "qv"}
    expected = greedy(llama_oracles["qv"], prompt, 6)
    for _ in range(2):  # (each executor, whichever the router picks)
        out = await client.completions.create(
            model="qv", prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.choices[0].text == Tokenizer.from_folder(tiny_llama).decode(expected)
    loaded = [ex.engine.runner.loras.slots for ex in runtime_mesh.executor_services]
    assert loaded == [{"qv": 1}, {"qv": 1}]
    assert (await post("/v1/load_lora_adapter", load))[0] == 200  # (idempotent)
    status, text = await post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/no"})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_path"
    assert "adapter_config.json" in json.loads(text)["error"]["message"]
    status, _ = await post("/v1/unload_lora_adapter", {"lora_name": "qv"})
    assert status == 200
    assert {m.id for m in (await client.models.list()).data} == {"tiny"}
    async with aiohttp.ClientSession() as session:
        body = {"model": "qv", "prompt": "x", "max_tokens": 1}
        async with session.post(f"{runtime_mesh.base_url}/completions", json=body) as resp:
            assert resp.status == 404
    status, text = await post("/v1/unload_lora_adapter", {"lora_name": "qv"})
    assert status == 404 and json.loads(text)["error"]["code"] == "model_not_found"
    status, text = await post("/v1/load_lora_adapter", {"lora_name": "qv"})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_path"
    status, text = await post("/v1/load_lora_adapter", {"lora_name": "q" * 300, "lora_path": "/x"})
    assert status == 400 and json.loads(text)["error"]["param"] == "lora_name"
    # the executors are idle: the name is free again at once, for another folder's weights
    _, everything = adapters["llama"]
    again = {"lora_name": "qv", "lora_path": str(everything)}
    assert (await post("/v1/load_lora_adapter", again))[0] == 200
    expected = greedy(llama_oracles["all"], prompt, 6)
    for _ in range(2):  # (the cached pages of the old "qv" are gone on both)
        out = await client.completions.create(
            model="qv", prompt=prompt, max_tokens=6, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert out.choices[0].text == Tokenizer.from_folder(tiny_llama).decode(expected)
    status, text = await post("/v1/load_lora_adapter", load)  # the name, another folder
    assert status == 400 and "loaded already, from" in json.loads(text)["error"]["message"]
    assert (await post("/v1/unload_lora_adapter", {"lora_name": "qv"}))[0] == 200
    # a gateway without --allow-runtime-lora-updating has no such route
    other = lora_mesh.base_url.removesuffix("/v1")
    assert (await post("/v1/load_lora_adapter", load, other))[0] == 404
    await client.close()


def test_an_unloaded_adapter_is_freed_once_no_sequence_uses_it(tiny_llama, adapters) -> None:
    qv, everything = adapters["llama"]
    config = load_model(tiny_llama, progress=False).config
    loras = LoraSet([load_adapter("qv", qv, config)])
    loras.add(load_adapter("all", everything, config))
    assert loras.slots == {"qv": 1, "all": 2}
    with pytest.raises(ModelError, match="loaded already"):
        loras.add(load_adapter("qv", qv, config))
    assert loras.remove("qv") == 1 and loras.slots == {"all": 2}
    assert not loras.release({1})  # a sequence still runs on it: kept
    assert loras.adapters[0].layers and loras.retired == {1}
    with pytest.raises(AdapterBusy):  # (its pages are still hashed under the name)
        loras.add(load_adapter("qv", everything, config))
    assert loras.release({2})
    assert not loras.adapters[0].layers and not loras.retired
    loras.add(load_adapter("qv", everything, config))  # a new one under the name, slot 3
    assert loras.slots == {"all": 2, "qv": 3}
    assert loras.adapters[1].layers  # (the other one untouched)
    with pytest.raises(UnknownAdapter):
        loras.remove("nope")


def test_an_adapter_reloaded_under_its_name_finds_none_of_the_old_ones_pages(
    tiny_llama, adapters, llama_oracles
) -> None:
    from gpu.engine import Engine, EngineConfig
    from gpu.sampling_params import SamplingParams

    qv, everything = adapters["llama"]
    model = load_model(tiny_llama, progress=False)
    runner = ModelRunner(model, 64, PAGE)
    runner.load_loras(LoraSet([load_adapter("x", qv, model.config)]))
    engine = Engine(runner, EngineConfig(64, 8, True), eos_token_ids=[2])
    prompt = list(range(10, 31))

    def run(rid: str) -> tuple[list[int], int]:
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        engine.add_request(rid, prompt, params, lora="x")
        tokens, cached = [], 0
        while engine.has_unfinished():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
                cached = out.cached_tokens
        return tokens, cached

    first, _ = run("a")
    assert run("b")[1] == 20  # cached under the name
    runner.loras.remove("x")
    engine.step()  # (between steps: the slot and the name's pages are freed)
    runner.add_lora(load_adapter("x", everything, model.config))
    tokens, cached = run("c")
    expected = greedy(llama_oracles["all"], prompt, 5)
    assert (tokens, cached) == (expected, 0) and tokens != first


def fake_mesh(live: list[str], recent: list[str], answer: Any) -> tuple[Any, list[tuple[str, str]]]:
    """A gateway's mesh for ``update_everywhere``: ``answer(executor, update)`` per request."""
    from types import SimpleNamespace

    calls: list[tuple[str, str]] = []

    async def request(subject: str, update: Any, *args: Any, **kwargs: Any) -> Any:
        executor = subject.split(".")[1]
        calls.append((executor, update.path))
        result = answer(executor, update)
        if isinstance(result, BaseException):
            raise result
        return result

    executors = SimpleNamespace(live=lambda: live, recent=lambda: dict.fromkeys(recent))
    subjects = SimpleNamespace(executor_lora=lambda e: f"executor.{e}.lora")
    mesh = SimpleNamespace(
        liveness=SimpleNamespace(executors=executors),
        service=SimpleNamespace(subjects=subjects, request=request),
    )
    return mesh, calls


async def test_a_refused_load_is_undone_only_where_it_loaded_something() -> None:
    """e1 had the folder already (from its flags), e2 loaded it, e3 refused: only e2 unloads."""
    from common.runtime import RequestError
    from common.wire.executor import LoraUpdate, LoraUpdated
    from services.gateway.lora_admin import update_everywhere

    def answer(executor: str, update: Any) -> Any:
        if not update.path:
            return LoraUpdated([], True)
        if executor == "e3":
            return RequestError("no such folder", 400, param="lora_path")
        return LoraUpdated(["sql"], executor == "e2")

    mesh, calls = fake_mesh(["e1", "e2", "e3"], ["e1", "e2", "e3"], answer)
    with pytest.raises(RequestError) as refused:
        await update_everywhere(mesh, LoraUpdate("sql", "/m/sql"))
    assert refused.value.status == 400
    assert [c for c in calls if not c[1]] == [("e2", "")]


async def test_an_unload_forgives_a_draining_executor_that_does_not_answer() -> None:
    from common.runtime import NoAnswer, RequestError
    from common.wire.executor import LoraUpdate, LoraUpdated
    from services.gateway.lora_admin import update_everywhere

    def answer(executor: str, update: Any) -> Any:
        return NoAnswer("gone") if executor == "e2" else LoraUpdated([], True)

    mesh, _ = fake_mesh(["e1"], ["e1", "e2"], answer)
    await update_everywhere(mesh, LoraUpdate("sql"))  # (e2 drains: its silence is no failure)
    mesh, _ = fake_mesh(["e1", "e2"], ["e1", "e2"], answer)
    with pytest.raises(RequestError) as silent:  # a live one's silence is
        await update_everywhere(mesh, LoraUpdate("sql"))
    assert silent.value.status == 503


async def test_a_name_unloaded_while_in_use_is_free_again_once_its_requests_end(
    runtime_mesh, adapters, tmp_path
) -> None:
    """Unloaded mid-request: the request finishes on it; loading the name again is a 503
    (retry) until then, and succeeds once the executor is idle; a corrupt folder is a 400."""
    import aiohttp

    from tests.mesh import openai_client

    qv, everything = adapters["llama"]
    root = runtime_mesh.base_url.removesuffix("/v1")

    async def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{root}{path}", json=body) as resp,
        ):
            text = await resp.text()
            return resp.status, (json.loads(text) if resp.status != 200 else text)

    assert (await post("/v1/load_lora_adapter", {"lora_name": "b", "lora_path": str(qv)}))[0] == 200
    client = openai_client(runtime_mesh.base_url)
    stream = await client.completions.create(
        model="b", prompt=list(range(20, 30)), max_tokens=120, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = [await anext(aiter(stream))]
    assert (await post("/v1/unload_lora_adapter", {"lora_name": "b"}))[0] == 200
    again = {"lora_name": "b", "lora_path": str(everything)}
    status, error = await post("/v1/load_lora_adapter", again)
    assert status == 503 and "still serves requests" in error["error"]["message"]
    chunks += [c async for c in stream]
    assert chunks[-1].choices[0].finish_reason == "length"  # (it ran to its end on "b")
    await asyncio.sleep(0.3)
    assert (await post("/v1/load_lora_adapter", again))[0] == 200
    assert (await post("/v1/unload_lora_adapter", {"lora_name": "b"}))[0] == 200
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8}')
    (bad / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    status, error = await post("/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(bad)})
    assert status == 400 and error["error"]["param"] == "lora_path"
    assert "cannot read the adapter" in error["error"]["message"]
    await client.close()
