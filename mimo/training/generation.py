"""Generation from a checkpoint: ``mimo generate`` and its Python entry point.

::

    from mimo.training.generation import Generator, generate

    out = generate("configs/demo.yaml", "What colour is the shape?", images=["shape.png"])
    out.text, out.tokens            # the answer ("red"), its token ids (the end-of-turn token last)
    with Generator("runs/demo/ckpt/step-00000250", ["modules.language.parallel.tp=1",
                   "modules.language.parallel.dp=4", "modules.language.parallel.sequence_parallel=false"]) as g:
        g.generate("Where is the shape?", images=["shape.png"], temperature=0.7, top_k=5, seed=1)  # one pool, many calls

The source is a config YAML (its newest usable checkpoint in ``train.checkpoint.dir``, or
``checkpoint=``) or a checkpoint: a ``step-N`` folder or a folder of them (its newest usable
one), or a run directory; the config is then the one the checkpoint recorded (its
``meta.json``, else the run directory's ``config.yaml``). Overrides apply either way, so a
checkpoint runs at any layout: written at another one, it is resharded on load, with a warning,
exactly as ``mimo eval`` loads it.

Everything a user can get wrong is checked here, before any process starts: the source, the
checkpoint, the image files (read and decoded), the prompt against the config's placeholders.
A prompt is a user turn of the config's chat template followed by the template's opening of the
assistant turn — what a held-out sample's prompt is in ``mimo eval`` (everything before the
answer, ``mimo.data.text``: tokenized piece by piece, with the tokenizer's bos) — so that a
model answers as it learned to. Its images take the places of the encoders' placeholders; a
prompt without any gets one line per image and encoder in front (``<image>\\n``, as the
training captions and the demo's questions have them). A native-resolution encoder
(``kind: qwen3_vl``) takes each image at its own size, as training does: its grid and rows are
read from the file's header (an image it cannot cut is a DataError naming the file), and its
placeholder becomes the vision start text, the image's own rows, the vision end text.

Then ``world_size`` local processes (``WorkerPool``, as ``mimo eval``) each build the model at
the config's layout, load the checkpoint, and read the prompts through the training data
pipeline as one microbatch (a reader of its own in place of the shards': packs to the LLM ranks,
image bytes decoded as training's and routed to the encoder ranks, normalised there). The
generation loop is the evaluator's (``mimo.training.evaluation.Completer``: a prefill and
cached decode steps, through every module at its layout), with the next token ``Picker``'s:
the argmax at temperature 0 (the default: eval's greedy tokens), else a draw from
``softmax(logits / temperature)`` over the ``top_k`` largest, each prompt drawing from a
generator of its own seeded ``seed + its index`` on the CPU — the same seed gives the same
tokens at one layout (at another, logits that differ in their last bits may, rarely, tip a
draw). Generation stops at the template's end-of-turn token or after ``max_new_tokens``
(default ``eval.max_new_tokens``). ``logits=True`` keeps, per prompt, the full-vocabulary logits
of every step: row 0 at the prompt's last position, row t after the t-th new token (row t chose
``tokens[t]``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Sequence

from mimo.core.errors import CheckpointError, ConfigError, DataError

log = logging.getLogger("mimo.training.generation")

ANSWER = "answer"  # a stand-in assistant turn: the template renders the prompt up to where an answer starts


# ---------------------------------------------------------------- what the ranks get


@dataclass(frozen=True)
class ConfigSource:
    """A config as the ranks rebuild it: parsed YAML (a file's, or a checkpoint's record), overrides."""

    raw: dict
    overrides: tuple[str, ...]
    source: str  # the file it came from (named in errors)

    def load(self):
        from mimo.compose.config import config_from_dict

        return config_from_dict(self.raw, self.overrides, source=self.source)


@dataclass(frozen=True)
class EncodedPrompt:
    """One prompt as the data pipeline's reader delivers it."""

    tokens: list[int]  # the rendered prompt, up to where the answer starts
    image_starts: dict[str, list[int]]  # placeholder -> first position of each of its images
    image_files: dict[str, list[int]]  # placeholder -> the image file each occurrence takes
    images: list[bytes]  # the image files' bytes, decoded by the reader as training decodes a sample's
    # native placeholders (``kind: qwen3_vl`` towers): each occurrence's rows and grid (t, h, w),
    # as the index holds a sample's (``mimo.data.index.Entry``)
    image_rows: dict[str, list[int]] = field(default_factory=dict)
    image_grids: dict[str, list[list[int]]] = field(default_factory=dict)
    slot_files: dict[str, list[tuple[str, int, int]]] = field(default_factory=dict)  # (mimo.data.text.TokenizedSample's)


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen (module doc)."""

    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int | None = None  # None: the whole vocabulary
    seed: int = 0
    logits: bool = False  # keep every step's logits

    def check(self) -> None:
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:
            problems.append(f"temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            problems.append(f"top_k must be >= 1 (or unset: the whole vocabulary), got {self.top_k}")
        if problems:
            raise ConfigError(problems)


@dataclass(frozen=True)
class GenerateRequest:
    """What every rank needs (resolved once by the launcher)."""

    config: ConfigSource
    checkpoint: str
    prompts: list[EncodedPrompt]
    sampling: Sampling
    stop_id: int | None  # the end-of-turn token, when the marker is one token
    pad_id: int
    device: str  # cpu or cuda, as the pool was started


@dataclass
class Generation:
    """One prompt's result."""

    text: str  # the decoded new tokens up to the end-of-turn marker
    tokens: list[int]  # the new tokens (the end-of-turn token included when reached)
    finished: bool  # ended at the end-of-turn marker (else at max_new_tokens)
    prompt_tokens: int  # the rendered prompt's length
    logits: object = None  # with logits=True: float32 [len(tokens), vocab]; row t chose tokens[t]


# ---------------------------------------------------------------- the launcher


def resolve_source(source: str, overrides: Sequence[str] = (), checkpoint: str | None = None) -> tuple[ConfigSource, str]:
    """(config, ``step-N`` checkpoint folder) of a config file or a checkpoint (module doc)."""
    from mimo.core.schema import load_yaml
    from mimo.compose.config import load_config
    from mimo.training.checkpoint import META, resolve_checkpoint

    overrides = tuple(overrides)
    if os.path.isfile(source):
        config = load_config(source, overrides)  # every problem of the config and overrides, now
        config.require_trainable()  # (a native-resolution encoder cannot take synthetic data)
        with open(source, encoding="utf-8") as f:
            raw = load_yaml(f.read(), source=source)
        return ConfigSource(raw, overrides, source), resolve_checkpoint(checkpoint or config.train.checkpoint.dir)
    if not os.path.isdir(source):
        raise CheckpointError(f"{source}: no such config file or checkpoint directory")
    if checkpoint is not None:
        raise ConfigError(f"--checkpoint {checkpoint}: {source} is a checkpoint already; give a config file to load another one")
    run_config = os.path.join(source, "config.yaml")
    if not os.path.isfile(os.path.join(source, META)) and os.path.isfile(run_config):  # a run directory
        step = resolve_checkpoint(_run_checkpoints(source, run_config))
    else:
        step = resolve_checkpoint(source)
    raw, where = checkpoint_config(step)
    config = ConfigSource(raw, overrides, where)
    loaded = config.load()  # the overrides checked now, and what native-resolution encoders cannot do (synthetic data)
    loaded.require_trainable()
    return config, step


def _run_checkpoints(run_dir: str, run_config: str) -> str:
    """A run directory's checkpoint folder: its config's ``train.checkpoint.dir`` if that holds
    any (as written, relative to where training ran), else its ``checkpoints/``."""
    import yaml

    from mimo.training.checkpoint import complete_checkpoints

    with open(run_config, encoding="utf-8") as f:
        written = (((yaml.safe_load(f) or {}).get("train") or {}).get("checkpoint") or {}).get("dir")
    for candidate in [written, os.path.join(run_dir, "checkpoints")]:
        if candidate and complete_checkpoints(candidate):
            return candidate
    return os.path.join(run_dir, "checkpoints")  # none: resolve_checkpoint says so


def checkpoint_config(step: str) -> tuple[dict, str]:
    """(parsed config, where from) a checkpoint was written with: its ``meta.json``'s record,
    else its run directory's ``config.yaml`` (``<run>/checkpoints/step-N``)."""
    from mimo.core.schema import load_yaml
    from mimo.training.checkpoint import META, read_meta

    meta = read_meta(step)
    if isinstance(meta.get("config"), dict):
        return meta["config"], os.path.join(step, META)
    run_config = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(step))), "config.yaml")
    if not os.path.isfile(run_config):
        raise CheckpointError(f"{step}: {META} records no config and there is no {run_config}; give the config: "
                              f"mimo generate CONFIG --checkpoint {step}")
    with open(run_config, encoding="utf-8") as f:
        return load_yaml(f.read(), source=run_config), run_config


def read_image(path: str) -> bytes:
    """The bytes of an image file, checked to decode as a training sample's image does."""
    from mimo.data.shards import decode_image

    if not os.path.isfile(path):
        raise DataError(f"image {path}: no such file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise DataError(f"image {path}: cannot read it ({e.strerror or e})") from None
    try:
        decode_image(data)
    except DataError as e:
        raise DataError(f"image {path}: not a readable image ({e})") from None
    return data


def prompt_text(text: str, images: int, placeholders: Sequence[str]) -> str:
    """The user turn's text: as given when it places its images (it holds a placeholder), else
    one ``placeholder\\n`` line per image and encoder in front, as the training captions have them."""
    if not placeholders:
        if images:
            raise DataError(f"{images} image(s) given, but the config has no image encoder: it takes no images")
        if "<image>" in text:
            raise DataError("the prompt holds '<image>', but the config has no image encoder (no placeholder takes an image); "
                            "remove it")
        return text
    if images and not any(p in text for p in placeholders):
        return "".join(f"{p}\n" for _ in range(images) for p in placeholders) + text
    return text


def encode_prompt(encoder, text: str, images: list[bytes], placeholders: Sequence[str], spec=None,
                  names: Sequence[str] | None = None) -> EncodedPrompt:
    """``text`` with ``images`` as the config's template renders a user turn, up to the start of
    the assistant's answer (a ``mimo.data.text.TextEncoder`` over the config's tokenizer). ``spec``:
    the config's ``mimo.data.index.TextSpec`` when it has native-resolution placeholders: each
    image's grid and rows from its header, as the index reads a sample's (``names``: the image
    files, named in errors)."""
    from mimo.data.text import Turn
    from mimo.training.evaluation import last_answer

    grids: dict[str, list] = {}
    file_rows: dict[str, list[int]] | None = None
    if spec is not None and spec.native:
        grids, file_rows = {n.placeholder: [] for n in spec.native}, {n.placeholder: [] for n in spec.native}
        names = list(names) if names is not None else [f"{k}" for k in range(len(images))]
        for name, data in zip(names, images):
            try:
                g, r = spec.file_rows([data])
            except DataError as e:
                raise DataError(f"image {name}: a native-resolution encoder cannot take it ({e})") from None
            for p in g:
                grids[p] += g[p]
                file_rows[p] += r[p]
    turn = prompt_text(text, len(images), placeholders)
    try:
        sample = encoder.encode([Turn("human", turn), Turn("gpt", ANSWER)], len(images), file_rows)
    except DataError as e:
        raise DataError(f"the prompt and its {len(images)} image(s) do not fit the config's placeholders "
                        f"({', '.join(map(repr, placeholders)) or 'none'}): {e}") from None
    start, _ = last_answer(sample.target)
    image_grids = {p: [grids[p][f] for f in sample.image_files[p]] for p in grids}
    return EncodedPrompt(sample.tokens[:start], sample.image_starts, sample.image_files, list(images), sample.image_rows,
                         image_grids, sample.slot_files)


class Generator:
    """A config and checkpoint resolved once (``resolve_source``; errors before any process
    starts), and prompts completed on its layout's local processes (``generate``,
    ``generate_many``). The worker pool starts on first use and stays up until ``close`` (or the
    ``with`` block's end); ``pool``: one of the config's world size to run on instead (not closed here)."""

    def __init__(self, source: str, overrides: Sequence[str] = (), checkpoint: str | None = None, device: str = "auto",
                 timeout_s: float = 900.0, pool=None):
        from mimo.data.text import load_tokenizer
        from mimo.compose.inputs import text_spec
        from mimo.training.checkpoint import layout_change, read_meta
        from mimo.training.evaluation import end_marker
        from mimo.training.launch import resolve_device
        from mimo.training.train import under_torchrun

        if under_torchrun():  # each torchrun process would start a whole world of its own
            raise ConfigError("mimo generate starts its own local processes (world_size of them); run it without torchrun")
        self.source, self.checkpoint = resolve_source(source, overrides, checkpoint)
        self.config = config = self.source.load()
        if config.data.source != "webdataset" or config.data.tokenizer is None:
            raise ConfigError(f"data: generation needs the config's tokenizer (data.tokenizer, data.source webdataset); "
                              f"this config has source {config.data.source!r}, tokenizer {config.data.tokenizer!r}")
        self.meta = read_meta(self.checkpoint)
        change = layout_change(self.meta, config, self.checkpoint)
        if change:
            log.warning(change)
        self.tokenizer = load_tokenizer(config.data.tokenizer)
        self.spec = spec = text_spec(config)
        self.encoder = spec.text_encoder(self.tokenizer)  # native placeholders too (each image's own rows)
        self.placeholders = spec.placeholders
        self.end_marker, self.stop_id = end_marker(config, self.tokenizer)
        self.device = resolve_device(device, config.world_size) if pool is None else pool.device
        self.timeout_s, self._pool, self._own_pool = timeout_s, pool, pool is None

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._own_pool and self._pool is not None:
            self._pool.close()
            self._pool = None

    def generate(self, prompt: str, images: Sequence[str] = (), **sampling) -> Generation:
        """One prompt (with image files) completed; ``sampling``: ``Sampling``'s fields."""
        return self.generate_many([(prompt, images)], **sampling)[0]

    def generate_many(self, prompts: Sequence[str | tuple[str, Sequence[str]]], max_new_tokens: int | None = None,
                      temperature: float = 0.0, top_k: int | None = None, seed: int = 0, logits: bool = False) -> list[Generation]:
        """Several prompts (each a text, or (text, image files)) completed together, as one microbatch."""
        new = self.config.eval.max_new_tokens if max_new_tokens is None else max_new_tokens
        sampling = Sampling(new, temperature, top_k, seed, logits)
        sampling.check()
        encoded = [self.encode(*((p, ()) if isinstance(p, str) else p)) for p in prompts]
        self._check_lengths(encoded, sampling.max_new_tokens)
        req = GenerateRequest(self.source, self.checkpoint, encoded, sampling, self.stop_id, self.encoder.pad_id, self.device)
        results = self.pool().run(generate_rank, req)
        return [self._result(i, p, results) for i, p in enumerate(encoded)]

    def encode(self, text: str, images: Sequence[str] = ()) -> EncodedPrompt:
        """A prompt as the ranks get it (its images read and checked)."""
        if isinstance(images, str):
            images = [images]
        return encode_prompt(self.encoder, text, [read_image(p) for p in images], self.placeholders, self.spec, images)

    def pool(self):
        from mimo.training.launch import WorkerPool

        if self._pool is None:
            self._pool = WorkerPool(self.config.world_size, timeout_s=self.timeout_s, device=self.device)
        return self._pool

    def _check_lengths(self, prompts: list[EncodedPrompt], new: int) -> None:
        longest = self.config.llm.arch.max_seq_len
        for p in prompts:
            if len(p.tokens) + new > longest:
                raise DataError(f"the prompt is {len(p.tokens)} tokens; with {new} new ones that is more than the model's "
                                f"max_seq_len {longest}: shorten it or lower max_new_tokens")

    def _result(self, i: int, prompt: EncodedPrompt, results: list[dict]) -> Generation:
        import torch

        from mimo.training.evaluation import cut_at

        tokens = results[0]["generated"][i]  # every rank knows every sample's tokens
        rows = next((r["logits"][i] for r in results if i in r["logits"]), None)
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        finished = (bool(tokens) and tokens[-1] == self.stop_id) or (bool(self.end_marker) and self.end_marker in text)
        return Generation(cut_at(text, self.end_marker), tokens, finished, len(prompt.tokens),
                          torch.stack(rows) if rows else None)

    @property
    def checkpoint_step(self) -> int:
        return int(self.meta["step"])


def generate(source: str, prompt: str, images: Sequence[str] = (), *, overrides: Sequence[str] = (), checkpoint: str | None = None,
             device: str = "auto", timeout_s: float = 900.0, **sampling) -> Generation:
    """One prompt completed from a checkpoint (``Generator(...).generate``; module doc).
    ``sampling``: ``max_new_tokens`` (default ``eval.max_new_tokens``), ``temperature`` (0:
    greedy), ``top_k``, ``seed``, ``logits``."""
    with Generator(source, overrides, checkpoint, device, timeout_s) as g:
        return g.generate(prompt, images, **sampling)


# ---------------------------------------------------------------- one rank


class Picker:
    """``Completer``'s next token for ``mimo generate`` (module doc): greedy (the evaluator's
    argmax, on the logits as they are) at temperature 0, else a seeded draw; keeps each prompt's
    logits rows when asked. Called on the last stage's TP rank 0 with full-vocabulary rows."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling
        self.logits: dict[int, list] = {}  # prompt -> its rows so far (float32, CPU)
        self._generators: dict[int, object] = {}

    def __call__(self, logits_NV, samples: list[int]) -> dict[int, int]:
        from mimo.training.evaluation import greedy

        s = self.sampling
        rows_NV = logits_NV.float().cpu() if s.logits or s.temperature > 0 else None
        if s.logits:
            for n, i in enumerate(samples):
                self.logits.setdefault(i, []).append(rows_NV[n].clone())
        if s.temperature == 0:
            return greedy(logits_NV, samples)
        return {i: self._draw(rows_NV[n], i) for n, i in enumerate(samples)}

    def _draw(self, logits_V, sample: int) -> int:
        import torch

        s = self.sampling
        scaled_V = logits_V.double() / s.temperature
        if s.top_k is not None and s.top_k < scaled_V.numel():
            kth = scaled_V.topk(s.top_k).values[-1]
            scaled_V = scaled_V.masked_fill(scaled_V < kth, float("-inf"))
        gen = self._generators.get(sample)
        if gen is None:
            gen = self._generators[sample] = torch.Generator().manual_seed(s.seed + sample)
        return int(torch.multinomial(torch.softmax(scaled_V, -1), 1, generator=gen))


class PromptReader:
    """The data pipeline's reader of encoded prompts, in place of ``SampleReader`` over the
    shards: a prompt's tokens (no labels; native placeholders' rows and grids beside them), and
    its image files decoded as ``SampleReader.read`` decodes a sample's (``decode_image``, then
    each encoder's rows of the files its placeholders take: one per image, or one per patch of
    the image cut at its own size for a native tower)."""

    def __init__(self, prompts: list[EncodedPrompt], feeds, pad_id: int):
        self.prompts, self.feeds, self.pad_id = prompts, feeds, pad_id

    def read(self, s):
        from mimo.data.pack import PackItem
        from mimo.data.pipeline import ReadSample, SampleReader
        from mimo.data.shards import decode_image

        p = self.prompts[s.id]
        images = [decode_image(b) for b in p.images]
        # as SampleReader: one row per image (fixed size), one per patch (native: the image cut at its own size)
        pixels = {f.name: SampleReader._pixels(f, p, images, [], []) for f in self.feeds}
        return ReadSample(PackItem(s.id, list(p.tokens), [False] * len(p.tokens), p.image_starts, image_rows=p.image_rows,
                                   image_grids=p.image_grids), pixels)


def generate_rank(req: GenerateRequest) -> dict:
    """Runs on every rank of the world (a WorkerPool worker with its group up, started for
    ``req.device``): the model at the config's layout with the checkpoint loaded, the prompts
    as one microbatch, completed. Returns every prompt's new tokens (every rank knows them) and
    the logits rows of the prompts this rank picked for."""
    import torch
    import torch.distributed as dist

    from mimo.compose.data_spec import text_spec
    from mimo.compose.inputs import data_pipeline, encoder_feeds
    from mimo.compose.model import MimoModel
    from mimo.data.plan import PlannedSample
    from mimo.training.checkpoint import load_checkpoint
    from mimo.training.evaluation import Completer, _Batches, generation_cache
    from mimo.training.launch import rank_compute_device
    from mimo.training.schedule_run import stage_runner

    config = req.config.load()
    model = MimoModel(config, dist.get_rank(), device=rank_compute_device(req.device))
    load_checkpoint(model, req.checkpoint, rng=False)
    samples = [PlannedSample(i, len(p.tokens), len(p.images), p.image_starts, p.image_rows, p.image_grids)
               for i, p in enumerate(req.prompts)]
    plan = _Batches(None, [samples])
    pipeline = data_pipeline(config, text_spec(config), model, plan, 1, ahead=False,
                             make_reader=lambda: PromptReader(req.prompts, encoder_feeds(config), req.pad_id))
    picker = Picker(req.sampling)
    try:
        cache = generation_cache(config)  # as the evaluator's
        completer = Completer(model, pipeline, stage_runner(model), req.sampling.max_new_tokens, req.stop_id, cache, picker)
        with torch.no_grad():
            mb = pipeline.microbatch(0)
            prompt = torch.zeros(len(samples), dtype=torch.int64)  # each length set once: by its DP block's reader
            tokens = {}
            for i, (toks, _) in completer.block_tokens(mb).items():
                tokens[i] = toks
                if pipeline.is_reader:
                    prompt[i] = len(toks)
            generated = completer.complete(mb, prompt, tokens)
    finally:
        pipeline.close()
    return {"generated": generated, "logits": picker.logits}
