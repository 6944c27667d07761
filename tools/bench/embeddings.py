"""Embeddings through the whole mesh against transformers, as a document indexer sends them.

    python -m tools.bench.embeddings [--model PATH] [--texts 256] [--batch 64] [--clients 4] \\
        [--rounds 3] [--quantization none]

``--texts`` passages of 40 to 160 tokens (random words), embedded by three sides that take
turns for ``--rounds`` rounds, warmed alike, each round's passages new to them all (the mesh's
prefix cache holds none of them):

- mesh: ``meshserve up`` (nats-server and one process per service, the executor as ``up``
  builds it) driven over HTTP: ``--clients`` clients each posting ``/v1/embeddings`` requests
  of ``--batch`` passages until all are embedded;
- transformers batched: what sentence-transformers does, in this process: passages sorted by
  length, padded batches of 32, the base model in fp32, the last real token of each pooled;
- transformers one by one: each passage alone.

Timed from the first request sent to the last vector in hand. Every side pools as the model's
folder says (``gpu.pooler_config``; the default model has no sentence-transformers files:
the last token, normalized); the table also gives the lowest cosine similarity between the
mesh's vectors and transformers' batched ones.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

import aiohttp
import numpy as np
import torch
import torch.nn.functional as F

from common.tokenizer import Tokenizer
from gpu.gguf import resolve_model_path
from gpu.pooler_config import PoolerConfig
from services.launcher.mesh import LocalMesh
from services.launcher.up import parse_up_args
from tools.bench.scoring import WORDS

ST_BATCH = 32  # sentence-transformers' default batch size


def passages(tokenizer: Tokenizer, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randrange(40, 161)
        text = " ".join(rng.choice(WORDS) for _ in range(length))
        out.append(tokenizer.encode(text)[:length])
    return out


class Transformers:
    def __init__(self, folder: Path, pooler: PoolerConfig) -> None:
        from transformers import AutoModel

        self.model = AutoModel.from_pretrained(folder, torch_dtype=torch.float32).eval()
        self.pooler = pooler

    @torch.inference_mode()
    def embed(self, texts: list[list[int]], batch: int) -> list[np.ndarray]:
        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out: dict[int, np.ndarray] = {}
        for start in range(0, len(order), batch):
            chosen = order[start : start + batch]
            width = max(len(texts[i]) for i in chosen)
            ids = torch.zeros(len(chosen), width, dtype=torch.int64)
            mask = torch.zeros(len(chosen), width, dtype=torch.int64)
            for row, i in enumerate(chosen):
                ids[row, : len(texts[i])] = torch.tensor(texts[i])
                mask[row, : len(texts[i])] = 1
            hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
            for row, i in enumerate(chosen):
                out[i] = self.pool(hidden[row, : len(texts[i])]).numpy()
        return [out[i] for i in range(len(texts))]

    def pool(self, hidden: torch.Tensor) -> torch.Tensor:
        mode = self.pooler.pooling
        vector = {"last": hidden[-1], "mean": hidden.mean(0), "cls": hidden[0]}[mode]
        return F.normalize(vector, dim=0) if self.pooler.normalize else vector


async def embed_mesh(
    url: str, texts: list[list[int]], batch: int, clients: int
) -> list[np.ndarray]:
    batches = [list(range(s, min(s + batch, len(texts)))) for s in range(0, len(texts), batch)]
    out: dict[int, np.ndarray] = {}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def client() -> None:
            while batches:
                chosen = batches.pop(0)
                body = {"model": "bench", "input": [texts[i] for i in chosen]}
                async with session.post(f"{url}/v1/embeddings", json=body) as response:
                    data = await response.json()
                    assert response.status == 200, data
                for i, item in zip(chosen, data["data"], strict=True):
                    out[i] = np.asarray(item["embedding"], dtype=np.float32)

        await asyncio.gather(*(client() for _ in range(clients)))
    return [out[i] for i in range(len(texts))]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench.embeddings", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64, help="passages per mesh request")
    parser.add_argument("--clients", type=int, default=4, help="concurrent mesh requests")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=8125)
    parser.add_argument(
        "--quantization",
        default=None,
        help="the mesh's weights (meshserve up's --quantization; default: up's, auto)",
    )
    args = parser.parse_args(argv)
    folder = resolve_model_path(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    pooler = PoolerConfig.from_folder(folder)
    up = parse_up_args([])
    up.model, up.port, up.served_model_name = str(folder), args.port, "bench"
    if args.quantization is not None:
        up.quantization = args.quantization
    hf = Transformers(folder, pooler)
    mesh = LocalMesh(up, folder)
    seconds: dict[str, list[float]] = {"mesh": [], "transformers batched": [], "one by one": []}
    worst, round_tokens = 1.0, []
    try:
        mesh.start()
        mesh.wait_ready(600)
        warm = passages(tokenizer, 16, seed=99)
        asyncio.run(embed_mesh(mesh.base_url, warm, args.batch, args.clients))
        hf.embed(warm, ST_BATCH)
        hf.embed(warm[:4], 1)
        for r in range(args.rounds):
            texts = passages(tokenizer, args.texts, seed=r)  # new to the prefix cache
            round_tokens.append(sum(len(t) for t in texts))
            start = time.perf_counter()
            got = asyncio.run(embed_mesh(mesh.base_url, texts, args.batch, args.clients))
            seconds["mesh"].append(time.perf_counter() - start)
            start = time.perf_counter()
            want = hf.embed(texts, ST_BATCH)
            seconds["transformers batched"].append(time.perf_counter() - start)
            start = time.perf_counter()
            hf.embed(texts, 1)
            seconds["one by one"].append(time.perf_counter() - start)
            for a, b in zip(got, want, strict=True):
                cosine = float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
                worst = min(worst, cosine)
    finally:
        mesh.stop()
    tokens = statistics.mean(round_tokens)
    pooled = f"{pooler.pooling}{', normalized' if pooler.normalize else ''}"
    print(
        f"\nmodel {folder.name} (CPU; the mesh's weights as up loads them: --quantization "
        f"{up.quantization}; transformers: fp32; pooling: {pooled}), {args.texts} passages "
        f"of 40-160 tokens (~{tokens:.0f} tokens a round), mesh: {args.clients} clients x "
        f"{args.batch} passages a request, {args.rounds} rounds\n"
    )
    print("| side | round seconds | median s | passages/s | tokens/s | vs one by one |")
    print("|---|---|---|---|---|---|")
    base = statistics.median(seconds["one by one"])
    for side, times in seconds.items():
        median = statistics.median(times)
        print(
            f"| {side} | {', '.join(f'{t:.2f}' for t in times)} | {median:.2f} | "
            f"{args.texts / median:.1f} | {tokens / median:.0f} | {base / median:.2f}x |"
        )
    print(f"\nlowest cosine similarity, mesh against transformers batched: {worst:.6f}")


if __name__ == "__main__":
    main()
