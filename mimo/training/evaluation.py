"""Held-out evaluation on a built model, at its layout: ``mimo eval`` (``mimo.commands.eval``) and
``eval.every`` during ``mimo train`` run it on every rank of the world.

``Evaluator(config, model, request)`` builds the held-out microbatches once: the first
``eval.samples`` usable held-out samples in shard order, grouped by
``data.tokens_per_microbatch``, delivered by the training data pipeline (each sample read
once, packs to LLM ranks, pixels to encoder ranks). ``run()`` evaluates the model as it is
now; training calls it again every ``eval.every`` steps on the same pipeline.

Loss: the training loss — token losses on the assistant tokens, summed over every sample and
divided by their count — computed by the same encoder + bridge + LLM stage forward
(``mimo.training.schedule_run.forward_only``: training's runners, without autograd).

Generation: greedy. A sample's prompt is everything before its *last* assistant answer; each
round appends the argmax at each still-unfinished sample's last position (the vocab-parallel
logits gathered over TP), each LLM DP rank for its own samples. The new tokens are summed over
the world (one small all-reduce), so every rank knows every sample's length and which samples
are done (end-of-turn token or ``eval.max_new_tokens``), and all ranks run the same rounds.
The loop (``Completer``) is ``mimo generate``'s too (``mimo.training.generation``: a user's
prompts instead of held-out samples, the next token greedy or sampled).

With ``eval.cache`` (the default) the first round is a *prefill*: the whole distributed forward
(encoders, bridges, every LLM stage) on the prompts, each LLM stage rank keeping a
``mimo.llm.cache.GenerationCache`` (attention keys / values of its local heads, Mamba-2 / GDN
states); every later round is a *decode step*: one token per unfinished sample, all of a DP
rank's in one pack, through the LLM stages only (the encoders ran once, in the prefill). Under
context parallelism (LLM cp > 1: a sample's positions are spread over the CP ranks), with
DeepSeek sparse attention layers (``D``: no cache of their indexer keys), and with
``eval.cache: false``, every round instead runs the whole forward again on prompt + generated
tokens; both give the same greedy tokens (up to float rounding of the logits).

Native-resolution towers (``kind: qwen3_vl``) and M-RoPE (Qwen3-VL): each image keeps its own
rows and grid through every round (a round of fewer samples cuts the tower's ``PatchBatch`` to
their images' patches and grids), and packs carry the samples' 3-D positions
(``PackedBatch.positions_3d``) as training's do. A decode step's token takes, on all three axes,
its index in its sequence plus its sample's ``rope_deltas`` (``max(prompt positions) + 1 - prompt
length``, taken from the prefill's pack: ``rope_deltas``), as Hugging Face's Qwen3-VL does under
a cache; a round without a cache recomputes the same positions from the layout (generated tokens
are text after the prompt), so both paths agree.

Exact match: the generated text up to the end-of-turn marker, normalised (whitespace
collapsed, surrounding whitespace stripped, lower case), equals the normalised reference
answer. Caption samples (a ``txt`` text, no question) are scored by the loss but not by
exact match: a caption is not a question with one checkable answer in general; they are
counted as ``captions``. Samples that fail to read are counted as ``read_failures``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import SimpleNamespace

from mimo.compose.config import MimoConfig
from mimo.core.errors import ConfigError

log = logging.getLogger("mimo.training.evaluation")

EXAMPLES = 5  # generated answers shown per scoring rank
COUNTS = ("matched", "scored", "captions", "read_failures", "generated_tokens")  # per rank; summed over the world


# ---------------------------------------------------------------- matching


def normalise(text: str) -> str:
    """How answers are compared: whitespace collapsed and stripped, lower case."""
    return " ".join(text.split()).lower()


def cut_at(text: str, end_marker: str) -> str:
    """The text before the first end-of-turn marker (all of it when there is none)."""
    return text.split(end_marker, 1)[0] if end_marker else text


def exact_match(generated: str, reference: str, end_marker: str) -> bool:
    return normalise(cut_at(generated, end_marker)) == normalise(cut_at(reference, end_marker))


def last_answer(target: list[bool]) -> tuple[int, int] | None:
    """(start, stop) of the last run of assistant tokens, or None when there is none."""
    stop = next((i + 1 for i in range(len(target) - 1, -1, -1) if target[i]), None)
    if stop is None:
        return None
    start = stop - 1
    while start > 0 and target[start - 1]:
        start -= 1
    return start, stop


# ---------------------------------------------------------------- the request (checked before any process starts)


@dataclass
class EvalRequest:
    """What every rank needs besides the config (resolved once by the launcher)."""

    checkpoint: str | None  # a step folder; None: the config's initial weights (tests)
    shards: str
    samples: int | None
    max_new_tokens: int
    end_marker: str  # the template's end-of-turn text
    stop_id: int | None  # its token id when it is one token


def end_marker(config: MimoConfig, tokenizer) -> tuple[str, int | None]:
    """The text that ends an assistant turn in the config's template, and its id if it is one token."""
    from mimo.data.text import Template

    marker = Template(config.data.template, tokenizer.eos_token or "", tokenizer).answer_end()
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"] if marker else []
    return marker, ids[0] if len(ids) == 1 else None


def request_for(config: MimoConfig, checkpoint: str | None, shards: str | None) -> EvalRequest:
    """Check everything a user can get wrong, before any process starts."""
    from mimo.training.checkpoint import layout_change, read_meta, resolve_checkpoint
    from mimo.data.config import missing_shards
    from mimo.data.text import load_tokenizer

    if config.data.source != "webdataset":
        raise ConfigError(f"data.source: mimo eval reads WebDataset shards and a tokenizer, got {config.data.source!r}")
    shards = shards or config.eval.shards
    if shards is None:
        raise ConfigError("eval.shards: not set; name the held-out shards in the config or pass --shards PATTERN")
    problems = missing_shards(shards, "--shards" if shards != config.eval.shards else "eval.shards")
    if problems:
        raise ConfigError(problems)
    if checkpoint is not None:
        checkpoint = resolve_checkpoint(checkpoint)
        change = layout_change(read_meta(checkpoint), config, checkpoint)
        if change:
            log.warning(change)
    marker, stop_id = end_marker(config, load_tokenizer(config.data.tokenizer))
    return EvalRequest(checkpoint, shards, config.eval.samples, config.eval.max_new_tokens, marker, stop_id)


# ---------------------------------------------------------------- one rank


def subset_blocks(blocks: list[range], keep: set[int]) -> list[range]:
    """DP blocks over the kept samples (in order), each kept sample staying in its block."""
    out, start = [], 0
    for block in blocks:
        n = sum(1 for i in block if i in keep)
        out.append(range(start, start + n))
        start += n
    return out


class _Batches:
    """A DataPlan stand-in for the data pipeline: exactly these global microbatches (then none)."""

    def __init__(self, index, batches: list[list]):
        self.index, self.batches = index, batches

    def microbatch(self, k: int) -> list:
        return self.batches[k] if k < len(self.batches) else []


def eval_batches(plan, samples: int | None) -> list[list]:
    """The plan's global microbatches (in shard order) until ``samples`` samples (None: all usable)."""
    want = len(plan.valid) if samples is None else min(samples, len(plan.valid))
    out, seen, k = [], 0, 0
    while seen < want:
        mb = plan.microbatch(k)[: want - seen]
        out.append(mb)
        seen, k = seen + len(mb), k + 1
    return out


class Evaluator:
    """The held-out microbatches of ``req`` on this rank, read by a data pipeline of their own
    (built once: construct on every rank of the world at the same point, as the training
    pipeline), and the model's loss and exact match on them (``run``)."""

    def __init__(self, config: MimoConfig, model, req: EvalRequest):
        from mimo.compose.data_spec import text_spec
        from mimo.compose.inputs import data_pipeline, ensure_index
        from mimo.data.plan import DataPlan
        from mimo.training.schedule_run import stage_runner

        self.model, self.req = model, req
        index, _ = ensure_index(config, shards=req.shards)
        d = config.data
        self.plan = DataPlan(index, d.tokens_per_microbatch, d.max_sample_tokens, d.seed, shuffle=False)
        self.batches = eval_batches(self.plan, req.samples)
        # training's, on these microbatches, inline: it runs between training steps, on the training groups
        self.pipeline = data_pipeline(config, text_spec(config), model, _Batches(index, self.batches), 1, ahead=False)
        self.runner = stage_runner(model)  # this rank's LLM stage, as training runs it (None without one)
        self.cache = generation_cache(config)

    def run(self) -> dict:
        """Collective (every rank): the global loss, this rank's counts (``COUNTS``), examples
        and generated tokens."""
        import torch
        import torch.distributed as dist

        scorer = _Scorer(self.model, self.pipeline, self.runner, self.req, self.cache)
        loss_sum = loss_tokens = 0.0
        with torch.no_grad():
            for k in range(len(self.batches)):
                mb = self.pipeline.microbatch(k)
                part_sum, part_tokens = _loss(self.model, self.runner, mb)
                loss_sum, loss_tokens = loss_sum + part_sum, loss_tokens + part_tokens
                scorer.generate(mb)
        totals = torch.tensor([loss_sum, loss_tokens], dtype=torch.float64)
        dist.all_reduce(totals)
        return {
            "loss": totals[0].item() / max(totals[1].item(), 1.0), "loss_tokens": int(totals[1].item()),
            "samples": sum(len(b) for b in self.batches), "skipped": self.plan.skipped_counts(),
            **scorer.counts, "examples": scorer.examples, "generated": scorer.generated,
        }

    def run_summed(self) -> dict:
        """Collective: ``run`` with the counts summed over the world and the exact match (as
        ``summarise`` reports them), without the examples."""
        import torch
        import torch.distributed as dist

        result = self.run()
        counts = torch.tensor([result[k] for k in COUNTS], dtype=torch.int64)
        dist.all_reduce(counts)
        total = dict(zip(COUNTS, counts.tolist()))
        return {"loss": result["loss"], "loss_tokens": result["loss_tokens"],
                "exact_match": total["matched"] / total["scored"] if total["scored"] else None,
                "samples": result["samples"], **total}

    def close(self) -> None:
        self.pipeline.close()


def _loss(model, runner, mb) -> tuple[float, float]:
    """This rank's share of the loss sum and loss-token count (last stage, TP rank 0 only, so
    the world sum counts each token once)."""
    from mimo.llm.model import count_loss_tokens
    from mimo.training.schedule_run import forward_only

    logits = forward_only(model, mb, runner)
    if logits is None:
        return 0.0, 0.0
    losses = model.llm.module.token_losses(logits, mb.pack)  # a collective over TP
    if model.llm.grid.coords(model.rank)["tp"] != 0:
        return 0.0, 0.0
    return float(losses.sum()), float(count_loss_tokens(mb.pack))


def greedy(logits_NV, samples: list[int]) -> dict[int, int]:
    """The argmax of each row: sample ``samples[n]``'s next token from row ``n`` (the default pick)."""
    return dict(zip(samples, logits_NV.argmax(-1).tolist()))


def generation_cache(config: MimoConfig) -> bool:
    """Whether generation keeps a cache (module doc): ``eval.cache``, but not where a sample is
    spread over CP ranks, nor with DeepSeek sparse attention layers (their indexer keys are not
    cached: every round runs the whole forward instead)."""
    dsa = any(s.kind == "dsa" for s in config.llm.arch.all_layers())
    return config.eval.cache and config.llm.parallel.cp == 1 and not dsa


class Completer:
    """Generation over the distributed model (module doc): ``complete`` extends each sample's
    prompt by a token per round, until its stop token or ``max_new_tokens``. The next token is
    ``pick(logits_NV, samples)`` of the full-vocabulary logits at each sample's last position
    (on the last stage's TP rank 0): ``greedy`` by default; ``mimo generate`` samples with it too.
    Shared by the evaluator (``_Scorer``: prompts cut from held-out samples) and
    ``mimo.training.generation`` (prompts a user gave), so both run one loop."""

    def __init__(self, model, pipeline, runner, max_new_tokens: int, stop_id: int | None, cache: bool = False, pick=greedy):
        self.model, self.pipeline, self.runner, self.cache = model, pipeline, runner, cache
        self.max_new_tokens, self.stop_id, self.pick = max_new_tokens, stop_id, pick
        grid, rank = model.llm.grid, model.rank
        c = grid.coords(rank) if rank in grid else None
        self.dp = c["dp"] if c is not None else None
        self.is_last_tp0 = c is not None and model.llm.module.is_last and c["tp"] == 0
        self.block = range(0)  # this LLM rank's DP block of the microbatch being completed
        # sample -> its decode positions' offset (``rope_deltas``: M-RoPE's; 0 for 1-D positions), from the prefill
        self.deltas: dict[int, int] = {}

    def block_tokens(self, mb) -> dict[int, tuple[list[int], list[bool]]]:
        """On LLM ranks: each sample of this rank's DP block (by its index in ``mb``) with its
        tokens and loss mask, whole (under context parallelism too); empty elsewhere."""
        self.block = mb.plan.llm_blocks[self.dp] if mb.pack is not None else range(0)
        if mb.pack is None:
            return {}
        whole = self._whole(mb.pack)
        cu = whole.cu_seqlens.tolist()
        out = {}
        for j, i in enumerate(self.block):
            n = mb.plan.samples[i].tokens
            out[i] = whole.tokens[cu[j] : cu[j] + n].tolist(), whole.loss_mask[cu[j] : cu[j] + n].tolist()
        return out

    def complete(self, mb, prompt, tokens: dict[int, list[int]]) -> dict[int, list[int]]:
        """Collective (every rank, after ``block_tokens``): the new tokens of every sample of
        ``mb`` whose ``prompt`` length is > 0 (``prompt``: int64 ``[samples]``, each length set
        on exactly one rank, 0 elsewhere; summed here). ``tokens``: on LLM ranks, each block
        sample's tokens, of which the first ``prompt`` are its prompt."""
        import torch
        import torch.distributed as dist

        from mimo.llm.cache import GenerationCache

        n = len(mb.plan.samples)
        dist.all_reduce(prompt)
        self.deltas = {}
        active = [i for i in range(n) if prompt[i] > 0]
        generated: dict[int, list[int]] = {i: [] for i in active}
        # this stage's cache of this DP block's unfinished samples, row r = the r-th in block order
        cache = GenerationCache(self.max_new_tokens) if self.cache and self.runner is not None else None
        prefilled = False
        while active:
            nxt = torch.zeros(n, dtype=torch.int64)
            if prefilled:
                picked = self._step(mb, active, prompt, generated, cache)
            else:
                picked = self._round(mb, active, prompt, tokens, generated, cache)
                prefilled = self.cache
            if picked is not None:
                for i, tok in picked.items():
                    nxt[i] = tok + 1  # 0 means "not mine"
            dist.all_reduce(nxt)
            still = []
            for i in active:
                tok = int(nxt[i]) - 1
                generated[i].append(tok)
                if tok != self.stop_id and len(generated[i]) < self.max_new_tokens:
                    still.append(i)
            if cache is not None:  # finished samples leave the cache
                going = set(still)
                cache.keep([r for r, i in enumerate(self._mine(active)) if i in going])
            active = still
        return generated

    def _whole(self, batch):
        """The whole DP pack's tokens and loss mask (under context parallelism every CP rank
        holds only its chunks: gathered over the CP group and put back in order)."""
        import torch

        from mimo.parallel.collectives import all_gather_along
        from mimo.parallel.layout import PackLayout

        info = batch.cp
        if info is None:
            return batch
        model = self.model
        tp = model.llm.ctx.tp_size
        lens = [2 * info.cp * c for c in info.chunk_lens]
        layout = PackLayout(tuple(lens), tp, info.cp, model.llm.ctx.sequence_parallel)
        got = all_gather_along(torch.stack([batch.tokens, batch.loss_mask.long()]).cpu(), 1, model.llm.ctx.cp)
        order = torch.tensor([p for r in range(info.cp) for p in layout.cp_local_index(r)], dtype=torch.int64)
        tokens, mask = torch.empty_like(got).index_copy_(1, order, got)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        return SimpleNamespace(tokens=tokens, loss_mask=mask.bool(), cu_seqlens=cu)

    def _mine(self, active: list[int]) -> list[int]:
        """This LLM rank's DP block's samples among ``active``, in block order (its pack's order)."""
        keep = set(active)
        return [i for i in self.block if i in keep]

    def _round(self, mb, active: list[int], prompt, tokens: dict, generated: dict, cache=None) -> dict[int, int] | None:
        """One forward of the active samples (prompt + generated so far); the last stage's TP
        rank 0 returns the picked token at each of its samples' last position. With ``cache`` (this
        stage's, empty) the forward is its prefill, and each of this rank's samples' M-RoPE offset
        (``rope_deltas``) is kept for the decode steps."""
        import dataclasses

        from mimo.data.pack import cp_share, pack
        from mimo.data.pipeline import Microbatch
        from mimo.parallel.layout import PackLayout
        from mimo.training.schedule_run import forward_only

        model, cfg = self.model, self.model.config
        keep = set(active)
        lengths = {i: int(prompt[i]) + len(generated[i]) for i in active}
        samples = [dataclasses.replace(mb.plan.samples[i], tokens=lengths[i]) for i in active]
        llm_blocks = subset_blocks(mb.plan.llm_blocks, keep)
        enc_blocks = {name: subset_blocks(b, keep) for name, b in mb.plan.encoder_blocks.items()}
        pixels = {name: self._kept_pixels(mb, name, x, keep) for name, x in mb.pixels.items()}
        batch, order = None, []
        if mb.pack is not None:
            par = cfg.llm.parallel
            order = self._mine(active)
            items = [_item(mb.plan.samples[i], tokens[i][: int(prompt[i])] + generated[i]) for i in order]
            whole = pack(items, self.pipeline.rows_per_image, par.tp, par.cp, model.llm.ctx.sequence_parallel,
                         self.pipeline.pad_id, self.pipeline.mrope_merge)
            if cache is not None:
                self.deltas = rope_deltas(whole, [lengths[i] for i in order], order)
            cp_rank = model.llm.ctx.dense.coord("cp")
            batch = cp_share(whole, cp_rank).to(model.device)  # packed on the CPU; the pixels are on the device already
        logits = forward_only(model, Microbatch(self.pipeline.plan_microbatch(samples, None, llm_blocks, enc_blocks), batch, pixels),
                              self.runner, cache)
        if logits is None:
            return None
        cu = whole.cu_seqlens.tolist()
        if batch.cp is None:
            mine = list(enumerate(order))
            last = [cu[j] + lengths[i] - 1 for j, i in mine]
        else:  # each sample's last position lives on one CP rank: that rank answers for it
            layout = PackLayout(tuple(lengths[i] for i in order), par.tp, par.cp, model.llm.ctx.sequence_parallel)
            where = [(j, i, layout.locate_cp(j, lengths[i] - 1)) for j, i in enumerate(order)]
            mine = [(j, i) for j, i, (c, _) in where if c == cp_rank]
            last = [local for _, _, (c, local) in where if c == cp_rank]
        return self._pick(logits, last, [i for _, i in mine])

    def _kept_pixels(self, mb, name: str, x, keep: set[int]):
        """This encoder rank's input of ``mb`` (as delivered) cut to the samples in ``keep``: a
        fixed-size tower's images ``[images, C, S, S]``; a native tower's ``PatchBatch`` (each
        image's patches, ``rows * merge**2`` of them, and its grid)."""
        import torch

        from mimo.core.batch import PatchBatch

        model = self.model
        enc = model.config.encoders[name]
        mine = mb.plan.encoder_blocks[name][model.part(name).grid.coords(model.rank)["dp"]]
        placeholder = enc.placeholder  # a sample's images for this encoder (not all its files)
        if not enc.native:
            offsets, rows = 0, []
            for i in mine:
                images = mb.plan.samples[i].images_for(placeholder)
                if i in keep:
                    rows.append(x[offsets : offsets + images])
                offsets += images
            return torch.cat(rows) if rows else x[:0]
        merge2 = enc.arch.spatial_merge ** 2
        patch_at = image_at = 0
        patches, grids = [], []
        for i in mine:
            own = mb.plan.samples[i].image_rows.get(placeholder, ())
            n = sum(own) * merge2
            if i in keep:
                patches.append(x.pixels_PJ[patch_at : patch_at + n])
                grids.append(x.grids_N3[image_at : image_at + len(own)])
            patch_at, image_at = patch_at + n, image_at + len(own)
        if patch_at != x.pixels_PJ.shape[0] or image_at != x.grids_N3.shape[0]:
            raise RuntimeError(f"encoder {name!r}: {x.pixels_PJ.shape[0]} patches and {x.grids_N3.shape[0]} grids delivered, "
                               f"the block's samples have {patch_at} and {image_at}")
        return PatchBatch(torch.cat(patches) if patches else x.pixels_PJ[:0], torch.cat(grids) if grids else x.grids_N3[:0])

    def _step(self, mb, active: list[int], prompt, generated: dict, cache) -> dict[int, int] | None:
        """A decode step (with the cache the prefill filled): each of this DP block's active
        samples' latest token at its position, through this rank's LLM stage only; the last
        stage's TP rank 0 returns the picked token of each."""
        from mimo.llm.cache import decode_pack

        if self.runner is None:  # encoders ran in the prefill: nothing to do here
            return None
        model = self.model
        order = self._mine(active)
        # the new token's place in its sequence (the cache's length), plus its M-RoPE offset (module doc)
        positions = [int(prompt[i]) + len(generated[i]) - 1 + self.deltas[i] for i in order]
        batch = decode_pack([generated[i][-1] for i in order], positions, [mb.plan.samples[i].id for i in order],
                            model.llm.ctx.tp_size, model.llm.ctx.sequence_parallel, self.pipeline.pad_id,
                            mrope=self.pipeline.mrope_merge is not None)
        logits = self.runner.forward(batch.to(model.device), cache=cache).logits
        self.runner.finish()
        return None if logits is None else self._pick(logits, list(range(len(order))), order)

    def _pick(self, logits, rows: list[int], samples: list[int]) -> dict[int, int] | None:
        """The next token of each of ``samples`` (``pick``: greedy by default) from its row of this
        rank's vocab-parallel logits (gathered over TP: a collective); on the last stage's TP
        rank 0, else None."""
        import torch

        from mimo.parallel import gather_along

        rows = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        full = gather_along(logits.index_select(0, rows), -1, self.model.llm.tp_group)[:, : self.model.config.llm.arch.vocab]
        if not self.is_last_tp0:
            return None
        return self.pick(full, samples)


class _Scorer(Completer):
    """Greedy generation of each held-out sample's last answer, and exact-match scoring (module doc)."""

    def __init__(self, model, pipeline, runner, req: EvalRequest, cache: bool = False):
        super().__init__(model, pipeline, runner, req.max_new_tokens, req.stop_id, cache)
        self.req = req
        # the DP group's reader (tp = pp = 0) scores its samples; it holds the tokenizer
        self.is_scorer = pipeline.is_reader
        self.counts = {"matched": 0, "scored": 0, "captions": 0, "read_failures": 0, "generated_tokens": 0}
        self.examples: list[dict] = []
        self.generated: dict[int, list[int]] = {}  # sample id -> greedy tokens (scored samples)

    def _is_caption(self, sample) -> bool:
        files = self.pipeline.plan.index.entries[sample.id].files
        return "json" not in files and "txt" in files

    def generate(self, mb) -> None:
        """Collective: each scored sample's last answer generated from everything before it, then scored."""
        import torch

        prompt = torch.zeros(len(mb.plan.samples), dtype=torch.int64)  # each sample's prompt length (0: not generated)
        answers: dict[int, list[int]] = {}
        tokens: dict[int, list[int]] = {}  # on LLM ranks: this DP block's full sample tokens
        for i, (toks, mask) in self.block_tokens(mb).items():
            span = last_answer([False] + mask[:-1])  # loss_mask[t] marks token t+1 as a target
            tokens[i] = toks
            if self.is_scorer:
                if span is None:
                    self.counts["read_failures"] += 1
                elif self._is_caption(mb.plan.samples[i]):
                    self.counts["captions"] += 1
                else:
                    prompt[i] = span[0]
                    answers[i] = toks[span[0] : span[1]]
        generated = self.complete(mb, prompt, tokens)
        if self.is_scorer:
            self._score(answers, generated)
            self.generated.update({mb.plan.samples[i].id: generated[i] for i in answers})

    def _score(self, answers: dict[int, list[int]], generated: dict[int, list[int]]) -> None:
        tok = self.pipeline.reader.tokenizer
        for i, ref_ids in answers.items():
            gen = tok.decode(generated[i], skip_special_tokens=False)
            ref = tok.decode(ref_ids, skip_special_tokens=False)
            ok = exact_match(gen, ref, self.req.end_marker)
            self.counts["scored"] += 1
            self.counts["matched"] += ok
            self.counts["generated_tokens"] += len(generated[i])
            example = {"reference": normalise(cut_at(ref, self.req.end_marker)), "generated": normalise(cut_at(gen, self.req.end_marker)),
                       "match": ok}
            # a few answers, and the first misses (what a person wants to see)
            if len(self.examples) < EXAMPLES or (not ok and sum(not e["match"] for e in self.examples) < EXAMPLES):
                self.examples.append(example)


def _item(sample, tokens: list[int]):
    from mimo.data.pack import PackItem

    return PackItem(sample.id, tokens, [False] * len(tokens), sample.image_starts, image_rows=sample.image_rows,
                    image_grids=sample.image_grids)


def rope_deltas(whole, lengths: list[int], samples: list[int]) -> dict[int, int]:
    """Each packed sample's M-RoPE offset: ``max(its 3-D positions) + 1 - its length``, as
    Hugging Face's Qwen3-VL ``get_rope_index`` computes ``rope_deltas`` for a prompt (``whole``:
    the prompts' pack, sample ``samples[j]`` of ``lengths[j]`` tokens in segment j, before any CP
    cut); a decode step puts the token at sequence index c at position ``c + delta`` on all three
    axes. A pack without 3-D positions (a 1-D LLM, or no native tower): 0 each, its 1-D positions."""
    if whole.positions_3d is None:
        return dict.fromkeys(samples, 0)
    cu = whole.cu_seqlens.tolist()
    return {i: int(whole.positions_3d[:, cu[j] : cu[j] + n].max()) + 1 - n for j, (i, n) in enumerate(zip(samples, lengths))}
