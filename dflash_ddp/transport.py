"""The hidden-state channel: target ranks send batches with their tapped features to drafter ranks.

A message is three tensors sent point-to-point (NCCL on GPUs, gloo on CPU):
  header   int64[16]: version, kind (DATA/END), global batch g, epoch, batch size B, total tokens N,
           feature width, dtype code, the sender's cumulative send-wait (us) and in-flight depth
  ints     int64[2N + 2B]: token ids and response mask packed without padding, then lengths, sample ids
  features [N, K*H] the tapped features packed without padding (bf16 on GPU, fp32 on CPU)
Each target keeps at most `max_inflight` messages outstanding (backpressure). The drafter receives on
a background thread that pre-posts the next batch while the current one trains; both sides time their
waits. END messages close every (target, drafter) pair so that no send is left unmatched at exit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .data import Batch

VERSION = 1
HEADER_LEN = 16
DATA, END = 1, 2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class ChannelError(RuntimeError):
    """A peer died, got stuck past --dist_timeout, or disagrees on the schedule. Names the ranks involved."""


@dataclass
class Message:
    """One received batch with its provenance."""

    g: int
    epoch: int
    batch: Batch
    features: torch.Tensor  # [B, S, K*H], zeros at padding
    source: int
    sender_wait_s: float
    sender_inflight: int

    @property
    def nbytes(self) -> int:
        return self.features.numel() * self.features.element_size() + self.batch.input_ids.numel() * 16


def pack(
    batch: Batch, features: torch.Tensor, g: int, epoch: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(header, ints, packed features) for one batch; padding is dropped."""
    real = batch.attention_mask.bool().to(features.device)
    lengths = batch.attention_mask.sum(dim=1)
    ids = batch.input_ids[batch.attention_mask.bool()]
    mask = batch.loss_mask[batch.attention_mask.bool()]
    ints = torch.cat([ids, mask, lengths, batch.sample_ids]).to(torch.int64)
    packed = features[real].contiguous()
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:8] = torch.tensor(
        [VERSION, DATA, g, epoch, lengths.numel(), ids.numel(), packed.shape[1], DTYPES.index(packed.dtype)]
    )
    return header, ints, packed


def unpack(header: torch.Tensor, ints: torch.Tensor, packed: torch.Tensor) -> tuple[Batch, torch.Tensor]:
    """The inverse of `pack`: a right-padded Batch and [B, S, K*H] features (zeros at padding)."""
    b, n = int(header[4]), int(header[5])
    ids, mask, lengths, sample_ids = ints[:n], ints[n : 2 * n], ints[2 * n : 2 * n + b], ints[2 * n + b :]
    longest = int(lengths.max())
    attention = torch.arange(longest)[None, :] < lengths.cpu()[:, None]
    input_ids = torch.zeros(b, longest, dtype=torch.long)
    loss_mask = torch.zeros(b, longest, dtype=torch.long)
    input_ids[attention] = ids.cpu()
    loss_mask[attention] = mask.cpu()
    features = packed.new_zeros(b, longest, packed.shape[1])
    features[attention.to(packed.device)] = packed
    return Batch(input_ids, attention.long(), loss_mask, sample_ids.cpu()), features


def _header(kind: int, g: int = -1) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[:3] = torch.tensor([VERSION, kind, g])
    return header


class ChannelSender:
    """A target rank's side: asynchronous sends with at most `max_inflight` outstanding messages."""

    def __init__(self, rank: int, max_inflight: int, device: torch.device):
        self.rank = rank
        self.max_inflight = max_inflight
        self.device = device
        self.inflight: deque[tuple[int, list]] = deque()
        self.wait_s = 0.0

    def _comm(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.device.type == "cuda" else t

    def _drain_to(self, limit: int) -> None:
        while len(self.inflight) > limit:
            dst, works = self.inflight.popleft()
            start = time.perf_counter()
            try:
                for w in works:
                    w.wait()
            except RuntimeError as e:
                raise ChannelError(
                    f"target rank {self.rank}: sending to drafter rank {dst} failed ({e}); that rank died or is stuck"
                ) from None
            self.wait_s += time.perf_counter() - start

    def send(self, dst: int, batch: Batch, features: torch.Tensor, g: int, epoch: int) -> None:
        """Queue batch g for drafter rank `dst`; blocks only when max_inflight messages are outstanding."""
        self._drain_to(self.max_inflight - 1)
        header, ints, packed = pack(batch, features, g, epoch)
        header[8] = int(self.wait_s * 1e6)
        header[9] = len(self.inflight)
        tensors = [self._comm(header), self._comm(ints), packed]
        self.inflight.append((dst, [dist.isend(t, dst) for t in tensors]))

    def close(self, drafter_ranks: Iterable[int]) -> None:
        """Send END to every drafter and wait until everything sent has been received."""
        for dst in drafter_ranks:
            self.inflight.append((dst, [dist.isend(self._comm(_header(END)), dst)]))
        self._drain_to(0)


class ChannelReceiver:
    """A drafter rank's side: a background thread receives the scheduled batches in order."""

    def __init__(
        self,
        rank: int,
        schedule: list[tuple[int, int]],
        end_sources: list[int],
        device: torch.device,
        feature_dtype: torch.dtype,
        prefetch: int = 2,
    ):
        self.rank = rank
        self.device = device
        self.feature_dtype = feature_dtype
        self.queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self.wait_s = 0.0
        self.bytes_received = 0
        self._thread = threading.Thread(
            target=self._receive_all, args=(schedule, end_sources), name="hidden-state-receiver", daemon=True
        )
        self._thread.start()

    def _recv(self, shape, dtype, src: int, what: str) -> torch.Tensor:
        on = self.device if self.device.type == "cuda" else torch.device("cpu")
        t = torch.empty(shape, dtype=dtype, device=on)
        try:
            dist.recv(t, src)
        except RuntimeError as e:
            raise ChannelError(
                f"drafter rank {self.rank}: receiving {what} from target rank {src} failed ({e}); "
                f"target rank {src} died or is stuck (see --dist_timeout)"
            ) from None
        return t

    def _receive_all(self, schedule: list[tuple[int, int]], end_sources: list[int]) -> None:
        try:
            for g, src in schedule:
                header = self._recv((HEADER_LEN,), torch.int64, src, f"the header of batch {g}").cpu()
                if int(header[0]) != VERSION or int(header[1]) != DATA or int(header[2]) != g:
                    raise ChannelError(
                        f"drafter rank {self.rank}: expected batch {g} from target rank {src}, got header "
                        f"{header[:4].tolist()}; the ranks disagree on the schedule (same config everywhere?)"
                    )
                b, n, width, dtype = (int(x) for x in header[4:8])
                ints = self._recv((2 * n + 2 * b,), torch.int64, src, f"the tokens of batch {g}")
                packed = self._recv((n, width), DTYPES[dtype], src, f"the features of batch {g}")
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                batch, features = unpack(header, ints, packed.to(self.feature_dtype))
                message = Message(
                    g, int(header[3]), batch, features, src, int(header[8]) / 1e6, int(header[9])
                )
                self.bytes_received += (
                    packed.numel() * packed.element_size() + ints.numel() * 8 + HEADER_LEN * 8
                )
                self.queue.put(message)
            for src in end_sources:
                header = self._recv((HEADER_LEN,), torch.int64, src, "the end of the stream")
                if int(header[1]) != END:
                    raise RuntimeError(
                        f"drafter rank {self.rank}: target rank {src} sent more batches than scheduled"
                    )
            self.queue.put(None)
        except BaseException as e:  # handed to the training thread, which raises it
            self.queue.put(e)

    def get(self) -> Message:
        """The next scheduled batch; the time spent waiting for it is added to `wait_s`."""
        start = time.perf_counter()
        item = self.queue.get()
        self.wait_s += time.perf_counter() - start
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise ChannelError(f"drafter rank {self.rank}: the stream ended before the schedule did")
        return item

    def close(self) -> None:
        """Wait for the END messages (the stream's clean end)."""
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        self._thread.join()
