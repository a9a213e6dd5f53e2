"""Access traces of query-aware selection: what the heat predictor is trained on.

At every decode step, for every layer and level, selection scores a level's candidate blocks against the query and
chooses the top ones per KV head. The cache hands each choice to its observers as a `LayerChoice` (its own tensors,
no copies); `TraceRecorder` keeps them as `ChoiceEvent`s (numpy) and saves them as .npz; `trace_dataset` replays a
trace through access_stats.AccessStats, step by step as the prefetcher does online, into (features, labels).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flashmemory.errors import ConfigError
from flashmemory.kvcache.prefetch.access_stats import COLUMN, AccessStats, StepChoices
from flashmemory.kvcache.read.choice import LayerChoice


@dataclass
class ChoiceEvent:
    """One query-aware choice: one decode step, one layer, one level, every KV head."""

    seq_id: int
    step: int  # the sequence's position (tokens before the decoded one): one per decode step
    layer: int
    level: int  # 1 = L1 (host), 2 = L2 (disk)
    indices: np.ndarray  # [n] logical block indices of the candidates (int32)
    scores: np.ndarray  # [num_kv_heads, n] Quest upper-bound scores (float16)
    chosen: np.ndarray  # [num_kv_heads, budget] positions into `indices` (int16 / int32)
    query_mean: np.ndarray  # [num_kv_heads] mean of the query heads sharing each KV head (float32)
    num_blocks: int  # full blocks of the sequence at this step (for the position feature)


class TraceRecorder:
    """Owns a list of ChoiceEvents recorded from a live cache; saves and loads them as one .npz file."""

    def __init__(self) -> None:
        self.events: list[ChoiceEvent] = []

    def on_choose(self, choice: LayerChoice) -> None:
        self.events.append(ChoiceEvent(
            choice.seq_id, choice.step, choice.layer, choice.level, choice.indices.cpu().numpy().astype(np.int32),
            choice.scores.float().cpu().numpy().astype(np.float16), choice.chosen.cpu().numpy().astype(np.int32),
            choice.query_mean.float().cpu().numpy(), choice.num_blocks))

    def on_step_end(self, seq_id: int) -> None:
        pass

    def on_step_abort(self, seq_id: int) -> None:
        """Drop the failed step's choices (the last step recorded for the sequence)."""
        steps = [e.step for e in self.events if e.seq_id == seq_id]
        if steps:
            last = max(steps)
            self.events = [e for e in self.events if not (e.seq_id == seq_id and e.step == last)]

    def __len__(self) -> int:
        return len(self.events)

    def save(self, path: str | Path) -> None:
        """Write the events to `path` (.npz): flat arrays plus per-event offsets."""
        ev = self.events
        header = np.array([[e.seq_id, e.step, e.layer, e.level, len(e.indices), e.chosen.shape[1], e.num_blocks]
                           for e in ev], dtype=np.int64).reshape(len(ev), 7)
        heads = ev[0].scores.shape[0] if ev else 0
        np.savez_compressed(
            path,
            header=header,
            indices=np.concatenate([e.indices for e in ev]).astype(np.int32) if ev else np.zeros(0, np.int32),
            scores=np.concatenate([e.scores for e in ev], axis=1).astype(np.float16) if ev else np.zeros((0, 0)),
            chosen=np.concatenate([e.chosen for e in ev], axis=1).astype(np.int32) if ev else np.zeros((0, 0)),
            query_mean=np.stack([e.query_mean for e in ev]).astype(np.float32) if ev else np.zeros((0, heads)),
        )

    @classmethod
    def load(cls, path: str | Path) -> "TraceRecorder":
        try:
            data = np.load(path)
            header, indices, scores, chosen, qmean = (data[k] for k in ("header", "indices", "scores", "chosen",
                                                                          "query_mean"))
        except (OSError, KeyError, ValueError) as e:
            raise ConfigError(f"cannot read access trace {str(path)!r} ({e}); record one with `flashmemory trace`") \
                from e
        rec = cls()
        n_off = b_off = 0
        for row, qm in zip(header, qmean):
            seq_id, step, layer, level, n, budget, num_blocks = (int(x) for x in row)
            rec.events.append(ChoiceEvent(seq_id, step, layer, level, indices[n_off : n_off + n],
                                          scores[:, n_off : n_off + n], chosen[:, b_off : b_off + budget], qm,
                                          num_blocks))
            n_off += n
            b_off += budget
        return rec


def trace_steps(events: list[ChoiceEvent]) -> list[tuple[int, list[ChoiceEvent]]]:
    """Group a trace into (seq_id, one level's choices of one step), in the order the groups start. A group holds
    the choices sharing the sequence, step, level and candidates (one per layer; sequences decoding in one batch
    interleave theirs)."""
    groups: list[tuple[int, list[ChoiceEvent]]] = []
    open_groups: dict[tuple[int, int, int, int], list[ChoiceEvent]] = {}  # (seq, step, level, n) -> group
    for e in events:
        key = (e.seq_id, e.step, e.level, e.indices.size)
        group = open_groups.get(key)
        if group is None or any(x.layer == e.layer for x in group) or not np.array_equal(group[0].indices, e.indices):
            group = open_groups[key] = []
            groups.append((e.seq_id, group))
        group.append(e)
    return groups


def stack_events(group: list[ChoiceEvent]) -> StepChoices:
    """A recorded group (trace_steps) as the StepChoices the prefetcher builds online (through the same stack)."""
    return StepChoices.stack([
        LayerChoice(e.seq_id, e.step, e.layer, e.level, torch.from_numpy(e.indices), torch.from_numpy(e.scores),
                    torch.from_numpy(e.chosen), torch.from_numpy(e.query_mean), e.num_blocks, None)
        for e in group])


def trace_dataset(trace: TraceRecorder, horizon_steps: int = 1, levels: tuple[int, ...] = (2,),
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replay a trace into (features [rows, F], labels [rows], group [rows]).

    A row is one candidate block of one (step, layer, KV head) choice on one of `levels`; its label is 1 when the
    block is chosen (on any level) by the same layer and head at one of the next `horizon_steps` steps. `group`
    numbers the (seq, step, layer, head) choices so precision/recall can be computed per choice. Choices whose
    future is not in the trace are dropped.
    """
    if not trace.events:
        raise ConfigError("the access trace is empty: record it with decode steps over L1/L2 blocks")
    heads = trace.events[0].scores.shape[0]
    num_layers = 1 + max(e.layer for e in trace.events)
    chosen_at: dict[tuple[int, int, int], list[set[int]]] = {}  # (seq, step, layer) -> per head logical ids
    last_step: dict[int, int] = {}
    for e in trace.events:
        per_head = chosen_at.setdefault((e.seq_id, e.step, e.layer), [set() for _ in range(heads)])
        for h in range(heads):
            per_head[h].update(e.indices[e.chosen[h]].tolist())
        last_step[e.seq_id] = max(last_step.get(e.seq_id, e.step), e.step)
    stats: dict[int, AccessStats] = {}
    feats, labels, groups = [], [], []
    group = 0
    for seq_id, events in trace_steps(trace.events):
        step = stack_events(events)
        st = stats.setdefault(seq_id, AccessStats(num_layers, heads))
        st.update(step)
        if step.level not in levels or step.step + horizon_steps > last_step[seq_id]:
            continue
        f = st.features(step).permute(1, 2, 3, 0).numpy()  # [layers, heads, n, F]
        ids = events[0].indices.tolist()
        for li, e in enumerate(events):
            future = [chosen_at.get((seq_id, e.step + d, e.layer)) for d in range(1, horizon_steps + 1)]
            for h in range(heads):
                wanted = set().union(*(fut[h] for fut in future if fut is not None))
                feats.append(f[li, h])
                labels.append(np.fromiter((i in wanted for i in ids), dtype=np.float32, count=len(ids)))
                groups.append(np.full(len(ids), group, dtype=np.int64))
                group += 1
    if not feats:
        raise ConfigError(f"the trace has no choices on levels {levels} with {horizon_steps} later step(s) recorded")
    return np.concatenate(feats), np.concatenate(labels), np.concatenate(groups)


def lru_scores(features: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """The recency/LRU baseline's ranking score from the same feature rows [..., F]: most recently selected first,
    then the most often selected (no digest score, no interval statistics)."""
    return -features[..., COLUMN["recency_log"]] + 1e-3 * features[..., COLUMN["frequency"]]
