"""The hidden-state channel: target ranks send batches with their tapped features to drafter ranks.

A message is three kinds of tensors (four with soft targets) sent point-to-point (NCCL on GPUs, gloo on
CPU) as one batch of sends; the receiver takes the header, then the ints (which give the sequence lengths),
then the features, then the soft targets:
  header   int64[16] (`Header`): version, kind (DATA/END), global batch g, epoch, batch size B, total tokens N,
           feature width, dtype code, the sender's cumulative send-wait (us) and in-flight depth, top-k
  ints     int64[2N + 2B]: token ids and response mask packed without padding, then lengths, sample ids
  features B tensors [len_b, K*H]: each sequence's tapped features without its padding (bf16 on GPU,
           fp32 on CPU). They are views of the target's output, received straight into the drafter's
           padded buffer, so neither side copies features to pack or unpack them
  soft     with --target_topk k only: int32[N, k] token ids and bf16[N, k] probabilities of the target's
           top-k next tokens at each position, packed without padding (6k bytes a token)
Each target keeps at most `max_inflight` messages outstanding (backpressure). The drafter receives on
a background thread that pre-posts the next batch while the current one trains, and holds at most
`max_inflight` messages received (or arriving) that training has not taken yet, so that beside the batch
in training neither side buffers more than `max_inflight` messages (a 64K-token message of Qwen3-8B's
features is 2.5 GiB); both sides time their waits and measure the bytes they held. END messages close
every (target, drafter) pair so that no send is left unmatched at exit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import astuple, dataclass, fields, replace

import torch
import torch.distributed as dist

from dflash_ddp.data.batch import Batch, SoftTargets

VERSION = 1


HEADER_LEN = 16


DATA, END = 1, 2


@dataclass(frozen=True)
class Header:
    """The first tensor of every message, as named fields: `encode` writes them in this order into
    int64[HEADER_LEN] (the rest is zeros), `decode` reads them back. A new field goes at the end."""

    version: int = VERSION
    kind: int = DATA  # DATA or END
    g: int = -1  # the global batch
    epoch: int = 0
    batch_size: int = 0  # B
    num_tokens: int = 0  # N: real tokens, padding excluded
    width: int = 0  # feature width K*H
    dtype_code: int = 0  # index into DTYPES
    sender_wait_us: int = 0  # the sender's cumulative wait on backpressure
    sender_inflight: int = 0  # the sender's outstanding messages when it sent this one
    topk: int = 0  # soft targets per token (--target_topk), 0: none
    sender_peak_bytes: int = (
        0  # the most bytes the sender's outstanding messages have held, this one included
    )

    def encode(self) -> torch.Tensor:
        """The header as the int64[HEADER_LEN] tensor that travels."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[: len(fields(self))] = torch.tensor(astuple(self), dtype=torch.int64)
        return header

    @classmethod
    def decode(cls, header: torch.Tensor) -> Header:
        """The fields of a received int64[HEADER_LEN] tensor."""
        return cls(*header[: len(fields(cls))].tolist())


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class ChannelError(RuntimeError):
    """A peer died, got stuck past --dist_timeout, or disagrees on the schedule. Names the ranks involved."""


class PeerLost(ChannelError):
    """A send or receive failed because the peer rank died or got stuck: a consequence of that rank's
    failure, not a failure of this rank's own. (A drafter's receive that times out is a ChannelError of its
    own: it names the target rank that is stuck, which says nothing itself, so torchrun's summary shows it.)"""


def _timed_out(error: RuntimeError) -> bool:
    """Whether a failed send or receive ran out of --dist_timeout (the peer alive but silent), as gloo and
    NCCL word it, rather than losing its peer."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


@dataclass
class Message:
    """One received batch with its provenance."""

    g: int
    epoch: int
    batch: Batch
    features: torch.Tensor  # [B, S, K*H], zeros at padding
    soft: SoftTargets | None = None  # [B, S, k], zeros at padding (--target_topk)
    source: int = 0  # the target rank that sent it (0 in one process)
    sender_wait_s: float = 0.0  # that rank's cumulative wait on backpressure
    sender_inflight: int = 0  # its outstanding messages when it sent this one
    sender_peak_bytes: int = 0  # the most bytes its outstanding messages have held so far
    received_bytes: int = 0  # its bytes on the wire (`message_bytes`)


def message_bytes(header: Header) -> int:
    """The bytes of the message `header` announces: header, ints, features and soft targets, unpadded."""
    n, k = header.num_tokens, header.topk
    features = n * header.width * DTYPES[header.dtype_code].itemsize
    return HEADER_LEN * 8 + (2 * n + 2 * header.batch_size) * 8 + features + n * k * 6


def pack(
    batch: Batch, features: torch.Tensor, g: int, epoch: int, soft: SoftTargets | None = None
) -> tuple[Header, torch.Tensor, list]:
    """(header, ints, per-sequence feature views, then the soft targets' ids and probabilities when given)
    for one batch; padding is not sent."""
    lengths = batch.attention_mask.sum(dim=1)
    real = batch.attention_mask.bool()
    ints = torch.cat([batch.input_ids[real], batch.loss_mask[real], lengths, batch.sample_ids]).to(
        torch.int64
    )
    slices = [features[b, :n] for b, n in enumerate(lengths.tolist())]  # contiguous views, no copy
    if soft is not None:  # k values a token: packing copies little beside the features
        on = soft.ids.device
        slices += [soft.ids[real.to(on)], soft.probs[real.to(on)]]
    header = Header(
        g=g,
        epoch=epoch,
        batch_size=lengths.numel(),
        num_tokens=int(lengths.sum()),
        width=features.shape[-1],
        dtype_code=DTYPES.index(features.dtype),
        topk=0 if soft is None else soft.k,
    )
    return header, ints, slices


def unpack_tokens(header: Header, ints: torch.Tensor) -> Batch:
    """The right-padded Batch described by a header and its ints message."""
    b, n = header.batch_size, header.num_tokens
    ints = ints.cpu()
    ids, mask, lengths, sample_ids = ints[:n], ints[n : 2 * n], ints[2 * n : 2 * n + b], ints[2 * n + b :]
    attention = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    input_ids = torch.zeros(attention.shape, dtype=torch.long)
    loss_mask = torch.zeros(attention.shape, dtype=torch.long)
    input_ids[attention] = ids
    loss_mask[attention] = mask
    return Batch(input_ids, attention.long(), loss_mask, sample_ids)


def padded_feature_buffer(batch: Batch, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[B, S, width] with zeros at padding; the real positions are filled by the receives."""
    features = torch.empty(*batch.input_ids.shape, width, dtype=dtype, device=device)
    for b, n in enumerate(batch.attention_mask.sum(dim=1).tolist()):
        features[b, n:].zero_()
    return features


class ChannelSender:
    """A target rank's side: asynchronous sends with at most `max_inflight` outstanding messages.

    `device` is where the messages travel from: the target's GPU under NCCL, the CPU under gloo (features
    computed on a GPU are then copied to host memory first)."""

    def __init__(self, rank: int, max_inflight: int, device: torch.device):
        self.rank = rank
        self.max_inflight = max_inflight
        self.device = device
        self.inflight: deque[tuple[int, list, list]] = deque()
        self.wait_s = 0.0
        self.peak_bytes = (
            0  # the most bytes the outstanding messages' buffers have held (at most max_inflight)
        )

    def _comm(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device) if self.device.type == "cuda" else t

    def _drain_to(self, limit: int) -> None:
        while len(self.inflight) > limit:
            dst, works, _tensors = self.inflight.popleft()
            start = time.perf_counter()
            try:
                for w in works:
                    w.wait()
                if self.device.type == "cuda":  # NCCL's wait() only orders the stream: block for backpressure
                    torch.cuda.current_stream(self.device).synchronize()
            except RuntimeError as e:
                reason = (
                    "that rank stopped taking batches: stuck, or waiting for another target rank (see its message)"
                    if _timed_out(e)
                    else "that rank died (see its message)"
                )
                raise PeerLost(
                    f"target rank {self.rank}: sending to drafter rank {dst} failed ({e}); {reason}"
                ) from None
            self.wait_s += time.perf_counter() - start

    def send(
        self,
        dst: int,
        batch: Batch,
        features: torch.Tensor,
        g: int,
        epoch: int,
        soft: SoftTargets | None = None,
    ) -> None:
        """Queue batch g for drafter rank `dst`; blocks only when max_inflight messages are outstanding."""
        self._drain_to(self.max_inflight - 1)
        if soft is not None:
            soft = SoftTargets(soft.ids.to(self.device), soft.probs.to(self.device))
        header, ints, slices = pack(batch, features.to(self.device), g, epoch, soft)
        held = sum(t.nbytes for _, _, sent in self.inflight for t in sent)
        held += HEADER_LEN * 8 + ints.nbytes + sum(t.nbytes for t in slices)
        self.peak_bytes = max(self.peak_bytes, held)
        header = replace(
            header,
            sender_wait_us=int(self.wait_s * 1e6),
            sender_inflight=len(self.inflight),
            sender_peak_bytes=self.peak_bytes,
        )
        tensors = [self._comm(header.encode()), self._comm(ints), *slices]
        # One batch of sends per message (one NCCL group launch, not 2 + B). The tensors ride along with their
        # works: a send buffer must outlive the send.
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, dst) for t in tensors])
        self.inflight.append((dst, works, tensors))

    def close(self, drafter_ranks: Iterable[int]) -> None:
        """Send END to every drafter and wait until everything sent has been received."""
        for dst in drafter_ranks:
            end = self._comm(Header(kind=END).encode())
            self.inflight.append((dst, dist.batch_isend_irecv([dist.P2POp(dist.isend, end, dst)]), [end]))
        self._drain_to(0)


class ChannelReceiver:
    """A drafter rank's side: a background thread receives the scheduled batches in order, at most
    `max_buffered` of them ahead of training (a message's buffers are allocated only once it has a slot; the
    slot frees when training takes it). `peak_bytes`: the most bytes those messages have held.

    After `drain()` (the job is stopping early) it discards what still arrives and ends once every
    target has sent END, so that no target is left blocked on a send.
    """

    def __init__(
        self,
        rank: int,
        schedule: list[tuple[int, int]],
        end_sources: list[int],
        device: torch.device,
        feature_dtype: torch.dtype,
        channel_device: torch.device,
        max_buffered: int = 2,
    ):
        self.rank = rank
        self.device = device  # where the drafter trains
        self.channel_device = channel_device  # where messages arrive: the GPU under NCCL, else the CPU
        self.feature_dtype = feature_dtype
        self.queue: queue.Queue = queue.Queue()  # bounded by the slots (END and errors take none)
        self.slots = threading.Semaphore(max_buffered)
        self.held_bytes = 0
        self.peak_bytes = 0
        self._bytes_lock = threading.Lock()
        self.draining = threading.Event()
        self.error: BaseException | None = None
        self.wait_s = 0.0
        self.bytes_received = 0
        self._thread = threading.Thread(
            target=self._receive_all, args=(schedule, end_sources), name="hidden-state-receiver", daemon=True
        )
        self._thread.start()

    def _recv_into(self, tensors: list[torch.Tensor], src: int, what: str) -> None:
        """Receive into `tensors`, in order, as one batch of receives."""
        try:
            for work in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, src) for t in tensors]):
                work.wait()
        except RuntimeError as e:
            if _timed_out(e):  # nothing came: this rank is the one that can name the stuck one
                raise ChannelError(
                    f"drafter rank {self.rank}: nothing of {what} came from target rank {src} within "
                    f"--dist_timeout ({e}); target rank {src} is stuck (or --dist_timeout is too short for "
                    "one of its forwards)"
                ) from None
            raise PeerLost(
                f"drafter rank {self.rank}: receiving {what} from target rank {src} failed ({e}); "
                f"target rank {src} died (see its message above)"
            ) from None

    def _receive_header(self, src: int, what: str, on: torch.device) -> Header:
        header = torch.empty(HEADER_LEN, dtype=torch.int64, device=on)
        self._recv_into([header], src, what)
        return Header.decode(header.cpu())

    def _take_slot(self) -> bool:
        """Wait for room for one more message; False when the job started draining meanwhile (what arrives
        then is dropped at once and needs no slot)."""
        while not self.slots.acquire(timeout=0.1):
            if self.draining.is_set():
                return False
        return True

    def _count(self, nbytes: int) -> None:
        with self._bytes_lock:
            self.held_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def _hand_over(self, item) -> None:
        """Queue an item for the training thread, unless the job is draining (then drop it)."""
        if self.draining.is_set():
            if isinstance(item, Message):
                self._release(item)
            return
        self.queue.put(item)

    def _release(self, message: Message) -> None:
        self._count(-message.received_bytes)
        self.slots.release()

    def _receive_batch(self, header: Header, src: int, on: torch.device) -> Message:
        g, b, n, width, k = header.g, header.batch_size, header.num_tokens, header.width, header.topk
        ints = torch.empty(2 * n + 2 * b, dtype=torch.int64, device=on)
        self._recv_into([ints], src, f"batch {g}")
        batch = unpack_tokens(header, ints)  # the lengths, hence where each sequence's features go
        features = padded_feature_buffer(batch, width, DTYPES[header.dtype_code], on)
        rows = [features[row, :length] for row, length in enumerate(batch.attention_mask.sum(dim=1).tolist())]
        self._recv_into(rows, src, f"the features of batch {g}")
        soft = None
        if k:
            packed = [torch.empty(n, k, dtype=dt, device=on) for dt in (torch.int32, torch.bfloat16)]
            self._recv_into(packed, src, f"the soft targets of batch {g}")
            real = batch.attention_mask.bool().to(on)
            soft = SoftTargets(
                *(
                    torch.zeros(*real.shape, k, dtype=t.dtype, device=on).index_put_((real,), t)
                    for t in packed
                )
            )
        if on.type == "cuda":
            torch.cuda.current_stream(on).synchronize()  # the receiver thread's own stream
        received = message_bytes(header)
        self.bytes_received += received
        return Message(
            g=g,
            epoch=header.epoch,
            batch=batch,
            features=features.to(self.device, self.feature_dtype),  # from host memory under gloo
            soft=None if soft is None else SoftTargets(soft.ids.to(self.device), soft.probs.to(self.device)),
            source=src,
            sender_wait_s=header.sender_wait_us / 1e6,
            sender_inflight=header.sender_inflight,
            sender_peak_bytes=header.sender_peak_bytes,
            received_bytes=received,
        )

    def _receive_all(self, schedule: list[tuple[int, int]], end_sources: list[int]) -> None:
        on = self.channel_device
        if on.type == "cuda":  # receive on a stream of our own, so that receives overlap the training step
            torch.cuda.set_device(on)
            with torch.cuda.stream(torch.cuda.Stream(on)):
                self._receive_loop(schedule, end_sources, on)
        else:
            self._receive_loop(schedule, end_sources, on)

    def _receive_loop(
        self, schedule: list[tuple[int, int]], end_sources: list[int], on: torch.device
    ) -> None:
        ended: set[int] = set()
        try:
            for g, src in schedule:
                if src in ended:
                    continue
                header = self._receive_header(src, f"batch {g}", on)
                if header.kind == END and self.draining.is_set():  # that target stopped early, as asked
                    ended.add(src)
                    continue
                if header.version != VERSION or header.kind != DATA or header.g != g:
                    raise ChannelError(
                        f"drafter rank {self.rank}: expected batch {g} from target rank {src}, got version "
                        f"{header.version}, kind {header.kind}, batch {header.g}, epoch {header.epoch}; the "
                        "ranks disagree on the schedule (same config and dflash_ddp version everywhere?)"
                    )
                if not self._take_slot():  # draining: received (the target waits on it), then dropped
                    self._receive_batch(header, src, on)
                    continue
                self._count(message_bytes(header))  # counted before the buffers exist: the peak
                self._hand_over(self._receive_batch(header, src, on))
            for src in end_sources:
                if src in ended:
                    continue
                if self._receive_header(src, "the end", on).kind != END:
                    raise ChannelError(
                        f"drafter rank {self.rank}: target rank {src} sent more batches than scheduled"
                    )
            self._hand_over(None)
        except BaseException as e:  # handed to the training thread, which raises it
            self.error = e
            self._hand_over(e)

    def get(self) -> Message:
        """The next scheduled batch; the time spent waiting for it is added to `wait_s`."""
        start = time.perf_counter()
        item = self.queue.get()
        self.wait_s += time.perf_counter() - start
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise ChannelError(f"drafter rank {self.rank}: the stream ended before the schedule did")
        self._release(item)  # in training now: its slot goes to the next message
        if item.features.is_cuda:  # received on the receiver's stream, used on this one: tell the allocator
            stream = torch.cuda.current_stream(item.features.device)
            for t in (item.features, *(() if item.soft is None else (item.soft.ids, item.soft.probs))):
                t.record_stream(stream)
        return item

    def drain(self) -> None:
        """Stop handing batches over: from now on whatever arrives is dropped until every target's END."""
        self.draining.set()
        while not self.queue.empty():
            item = self.queue.get_nowait()
            if isinstance(item, Message):
                self._release(item)

    def close(self) -> None:
        """Wait for the END messages (the stream's clean end)."""
        if self.draining.is_set():
            self._thread.join()
            if self.error is not None:
                raise self.error
            return
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        self._thread.join()
