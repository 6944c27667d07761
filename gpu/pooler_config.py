"""How a model turns a prompt into one embedding (``/v1/embeddings``), read from its folder as
vLLM reads it: the sentence-transformers pipeline (``modules.json``: a ``Pooling`` module's
mode, a ``Normalize`` module) where the model has one, else the last token's hidden state,
L2-normalized (vLLM's default for a generative model served for embeddings). Matryoshka
models (``config.json``'s ``is_matryoshka`` or ``matryoshka_dimensions``) may be asked for
fewer dimensions.

No torch here: the tokenizer service reads it to fill in and check a request's pooling, the
engine (``gpu.pooling``) does what the request then says.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The hidden states an embedding is made of (every one after the model's final norm, as
# transformers' base model returns them): the prompt's last token's, the mean of all of its
# tokens', or its first token's.
POOLING_TYPES = ("last", "mean", "cls")

# sentence-transformers' Pooling modes, by their config key, that meshserve computes
_ST_MODES = {
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
_ST_OTHER_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_ST = "sentence_transformers.models."
_ST_KNOWN_MODULES = {_ST + "Transformer", _ST + "Pooling", _ST + "Normalize"}


class PoolingError(ValueError):
    """A request the model's pooling cannot serve (its message is the client's 400)."""


@dataclass(frozen=True)
class PoolerConfig:
    pooling: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    # Matryoshka: any size up to hidden_size may be asked for (``dimensions``), or only these
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()
    # sentence-transformers' max_seq_length (sentence_bert_config.json): the longest input it
    # embeds (vLLM caps the context with it); 0: the model's context
    max_seq_length: int = 0
    # Set where the folder's sentence-transformers pipeline does what meshserve does not (a
    # Dense projection, max pooling): every embedding request is refused with it, while the
    # model still serves completions.
    unsupported: str = ""

    @classmethod
    def from_folder(cls, folder: Path) -> PoolerConfig:
        raw = _read_json(folder / "config.json") or {}
        base = cls(hidden_size=int(raw.get("hidden_size", 0)))
        try:
            dims = raw.get("matryoshka_dimensions") or []
            if not isinstance(dims, list) or not all(isinstance(d, int) for d in dims):
                raise PoolingError(f"config.json's matryoshka_dimensions is malformed: {dims!r}")
            base = dataclasses.replace(
                base,
                matryoshka=bool(raw.get("is_matryoshka") or dims),
                matryoshka_dimensions=tuple(dims),
            )
            return base.with_pipeline(folder)
        except PoolingError as exc:  # (the model still serves completions)
            return dataclasses.replace(base, unsupported=str(exc))

    def with_pipeline(self, folder: Path) -> PoolerConfig:
        """This config with the pooling and normalization of the folder's
        sentence-transformers pipeline, if it has one."""
        modules = _read_json(folder / "modules.json")
        if modules is None:
            return self
        if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
            raise PoolingError("This model's modules.json is not a list of modules.")
        kinds = {str(m.get("type", "")): str(m.get("path", "")) for m in modules}
        others = sorted(k for k in kinds if k not in _ST_KNOWN_MODULES)
        if others:
            raise PoolingError(
                "This model's sentence-transformers pipeline has modules meshserve does not "
                f"run ({', '.join(others)}), so it serves no embeddings."
            )
        if (_ST + "Pooling") not in kinds:  # (vLLM too then keeps its default)
            return self
        settings = _read_json(folder / kinds[_ST + "Pooling"] / "config.json") or {}
        chosen = [mode for key, mode in _ST_MODES.items() if settings.get(key)]
        other = [key for key in _ST_OTHER_MODES if settings.get(key)]
        if other or len(chosen) != 1:
            named = ", ".join(other + [k for k in _ST_MODES if settings.get(k)]) or "none"
            raise PoolingError(
                f"This model's sentence-transformers pooling ({named}) is not one meshserve "
                "computes (one of last token, mean, CLS), so it serves no embeddings."
            )
        longest = (_read_json(folder / "sentence_bert_config.json") or {}).get("max_seq_length")
        return dataclasses.replace(
            self,
            pooling=chosen[0],
            normalize=(_ST + "Normalize") in kinds,
            max_seq_length=longest if isinstance(longest, int) and longest > 0 else 0,
        )

    def check(self, dimensions: int | None) -> None:
        """Raise ``PoolingError`` unless this model embeds, in ``dimensions`` if given (vLLM's
        rules: fewer than the hidden size only for a Matryoshka model, one of its listed sizes
        where it lists them)."""
        if self.unsupported:
            raise PoolingError(self.unsupported)
        if dimensions is None or dimensions == self.hidden_size:
            return
        if not 1 <= dimensions <= self.hidden_size:
            raise PoolingError(
                f"'dimensions' must be within 1..{self.hidden_size} (this model's embedding "
                f"size), got {dimensions}."
            )
        if not self.matryoshka:
            raise PoolingError(
                "This model does not support Matryoshka representations: 'dimensions' other "
                f"than its embedding size ({self.hidden_size}) would give poor embeddings "
                "(a model that supports them says so in its config.json: 'is_matryoshka' or "
                "'matryoshka_dimensions')."
            )
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            sizes = ", ".join(map(str, self.matryoshka_dimensions))
            raise PoolingError(
                f"This model supports only these 'dimensions': {sizes}; got {dimensions}."
            )


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PoolingError(f"{path.name} of this model could not be read: {exc}") from None
