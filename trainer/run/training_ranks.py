"""The controller and the training ranks: how one step's update is shared out.

With K training processes (torchrun), rank 0 is the controller. It alone owns the rollout --
the engine or the generation processes, APRIL's buffer and over-sampling, GRESO's traces, DAPO's
rounds, the data cursor, asynchronous admission and the staleness bound -- and it alone reports,
reads controls and writes checkpoints. So every technique behaves exactly as in one process, and
a K-process run samples what the one-process run samples. The other ranks only train.

Each step rank 0 splits the update's sequences the way one process would (optimizer mini-batch
i is `seqs[i::n]`), cuts every mini-batch into K shares of about equal token counts (`shares`:
the cost of a sequence's forward and backward grows with its length, so equal sequence counts
would leave ranks waiting on the one holding the long answers), and every rank back-propagates
its share through DistributedDataParallel. The loss is the token mean over the whole mini-batch
(trainer/algo/learner.py all-reduces the token count), so the update equals the one-process update
on the same batch up to float rounding.

Rank 0 talks to the others over a channel of its own: a gloo group (CPU objects, whatever the
training backend) whose collectives wait up to CHANNEL_TIMEOUT, so the other ranks may wait as
long as rank 0 needs -- a long evaluation, a pause, an asynchronous step waiting for groups,
generators all down -- while the training collectives keep RLPILOT_DIST_TIMEOUT_S. One
`broadcast_object` per message:
- TRAIN: the config (knob changes reach every rank with the step they apply to), the step, the
  decoupled-loss settings; then each rank's share by `scatter_object_list`; after the update the
  figures each rank wrote into its sequences' reports (the behaviour weights the rollout
  inspector shows) come back with `gather_object`, with the wall-clock start and end of each
  rank's update (the run's timeline: trainer/observe/timeline.py) and the rank's CPU seconds and
  resident memory (trainer/observe/system.py's ProcessMeter).
- LOGPROBS, WEIGHTS, CHECKPOINT (sharded models only, `cluster.sharding = "fsdp"`: every forward
  and every whole-model read is then a collective of all ranks): rank 0's log-prob recomputes
  (pi_old, the reference) cut into token-balanced shares like an update, each rank's results
  gathered back; the whole weights for the generators after an update (they land on rank 0);
  a checkpoint's model and optimizer shards, each rank writing its own into rank 0's folder.
- END: the run is over (its status); the ranks leave their loop ("failed": they raise, so
  torchrun reports the failure). Rank 0 sends no END when it fails in the middle of an update:
  the others are then inside the update's collectives, and a message would not match them; it
  exits instead, and torchrun stops the others.
"""
from __future__ import annotations

import dataclasses
import datetime

from trainer.algo.learner import TrainSequence
from trainer.observe import clock
from trainer.observe.system import process_usage

TRAIN, LOGPROBS, WEIGHTS, CHECKPOINT, END = "train", "logprobs", "weights", "checkpoint", "end"
CHANNEL_TIMEOUT = datetime.timedelta(days=7)   # a paused run may wait that long for its person


def mini_batches(seqs: list, n: int) -> list[list]:
    """Optimizer mini-batch i of n: every n-th sequence from the i-th (as the learner splits)."""
    return [seqs[i::n] for i in range(n)]


def shares(lengths: list[int], k: int) -> list[list[int]]:
    """Indices of `lengths` cut into k shares of about equal total length: longest first, each
    to the share with the fewest tokens so far (ties: the lower rank). Within a share the
    indices keep their order."""
    load, out = [0] * k, [[] for _ in range(k)]
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(k), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        out[r].append(i)
    return [sorted(s) for s in out]


def _portable(seq: TrainSequence) -> TrainSequence:
    """A copy to send: the report (the sample's own metadata on rank 0) travels empty."""
    return dataclasses.replace(seq, report={} if seq.report is not None else None)


class Controller:
    """Rank 0's side. With one process, `share` only splits into mini-batches and every other
    method does nothing."""

    def __init__(self, world):
        """Every rank makes one (the channel's group is made collectively)."""
        self.world = world
        self.imbalance = 1.0   # the last step's largest share over the mean share, in tokens
        self.in_update = False  # between sending the shares and gathering the reports
        self.channel = None
        if world.size > 1:
            import torch.distributed as dist

            self.channel = dist.new_group(backend="gloo", timeout=CHANNEL_TIMEOUT)

    def share(self, seqs: list[TrainSequence], cfg, step: int, decoupled_loss) -> list[list[TrainSequence]]:
        """Rank 0's own share of each mini-batch, after sending theirs to the other ranks."""
        n = cfg.optim.mini_batches
        if self.world.size == 1:
            return mini_batches(seqs, n)
        import torch.distributed as dist

        k = self.world.size
        per_rank: list[list[list]] = [[] for _ in range(k)]   # rank -> mini-batch -> [(index, seq)]
        indexed = list(enumerate(seqs))
        tokens = [0] * k
        for chunk in mini_batches(indexed, n):
            cut = shares([s.length for _, s in chunk], k)
            for r in range(k):
                part = [chunk[i] for i in cut[r]]
                per_rank[r].append(part)
                tokens[r] += sum(s.length for _, s in part)
        mean = sum(tokens) / k
        self.imbalance = max(tokens) / mean if mean else 1.0
        self._send((TRAIN, cfg, step, decoupled_loss))
        self.in_update = True
        out = [None]
        dist.scatter_object_list(out, [[[(i, _portable(s)) for i, s in part] for part in rank]
                                       for rank in per_rank], src=0, group=self.channel)
        self.sent = seqs
        return [[s for _, s in part] for part in per_rank[0]]

    def logprobs(self, learner, seqs: list[TrainSequence], pad_id: int, max_tokens: int,
                 reference: bool = False) -> list[list[float]]:
        """Per-token log-probabilities of `seqs` (learner.logprobs); sharded, every rank computes a
        token-balanced share."""
        if not learner.sharded:
            return learner.logprobs(seqs, pad_id, max_tokens, reference=reference)
        import torch.distributed as dist

        cut = shares([s.length for s in seqs], self.world.size)
        self._send((LOGPROBS, reference, max_tokens))
        box = [None]
        dist.scatter_object_list(box, [[_portable(seqs[i]) for i in part] for part in cut], src=0,
                                 group=self.channel)
        mine = learner.logprobs([seqs[i] for i in cut[0]], pad_id, max_tokens, reference=reference)
        got: list = [None] * self.world.size
        dist.gather_object(mine, got, dst=0, group=self.channel)
        out: list = [None] * len(seqs)
        for part, results in zip(cut, got):
            for i, lp in zip(part, results):
                out[i] = lp
        return out

    def full_weights(self, learner, only_changed: bool = False) -> dict:
        """The policy's whole tensors for the generators (sharded: gathered onto rank 0);
        `only_changed`: LoRA's adapted layers alone, for engines that keep the rest."""
        if learner.sharded:   # the others gather the same tensors: the same collectives
            self._send((WEIGHTS, only_changed))
        return learner.full_state_dict(only_changed)

    def save_shards(self, learner, folder) -> None:
        """Sharded: every rank writes its shards of the model and optimizer into `folder`."""
        from trainer.cluster import sharding

        self._send((CHECKPOINT, str(folder)))
        sharding.save(folder, learner.model, learner.optimizer)

    def gather_reports(self) -> list[tuple]:
        """After the update: the other ranks' report figures into rank 0's sequences. Returns
        (rank, start, end, CPU seconds, resident bytes) of each other rank: its update's
        wall-clock start and end, its process's usage after it."""
        if self.world.size == 1:
            return []
        import torch.distributed as dist

        got: list = [None] * self.world.size
        dist.gather_object(([], None), got, dst=0, group=self.channel)
        self.in_update = False
        for part, _ in got[1:]:
            for i, report in part:
                if self.sent[i].report is not None:
                    self.sent[i].report.update(report)
        self.sent = []
        return [(r, *got[r][1]) for r in range(1, self.world.size)]

    def end(self, status: str) -> None:
        """The run is over: the other ranks leave their loop. Not in the middle of an update
        (see the module docstring): the caller's error ends this process, and torchrun the rest."""
        if self.world.size > 1 and not self.in_update:
            self._send((END, status))

    def _send(self, message) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([message], src=0, group=self.channel)


def follow(controller: Controller, learner, pad_id: int, on_step=None) -> str:
    """A training rank's whole run: train each share rank 0 sends until it says END; returns
    the run's status (raises when rank 0 failed). `on_step(step, cfg)` is told each step before
    its update (the runner keeps rank 0's config and step)."""
    import torch.distributed as dist

    group = controller.channel
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        message = box[0]
        if message[0] == END:
            if message[1] == "failed":
                raise RuntimeError("rank 0 (the controller) failed: its error is in its log")
            return message[1]
        if message[0] == LOGPROBS:
            _, reference, max_tokens = message
            box = [None]
            dist.scatter_object_list(box, None, src=0, group=group)
            dist.gather_object(learner.logprobs(box[0], pad_id, max_tokens, reference=reference), None,
                               dst=0, group=group)
            continue
        if message[0] == WEIGHTS:
            learner.full_state_dict(only_changed=message[1])
            continue
        if message[0] == CHECKPOINT:
            from trainer.cluster import sharding

            sharding.save(message[1], learner.model, learner.optimizer)
            continue
        _, cfg, step, decoupled_loss = message
        box = [None]
        dist.scatter_object_list(box, None, src=0, group=group)
        mine = box[0]
        if on_step is not None:
            on_step(step, cfg)
        chunks = [[s for _, s in part] for part in mine]
        start = clock.now()
        learner.train([s for c in chunks for s in c], cfg, pad_id, [], decoupled_loss, chunks=chunks)
        reports = [(i, s.report) for part in mine for i, s in part if s.report]
        dist.gather_object((reports, (start, clock.now(), *(process_usage() or (0.0, 0)))), None, dst=0,
                           group=group)
