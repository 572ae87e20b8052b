"""Memory budgets in bytes: what one device, and every device together, may make the verifier hold.

Counts (sessions per device, items per session) do not bound memory: one fork of a full-context session
copies its whole KV, and one queued frame keeps up to `max_frame_bytes` alive. So each session is charged,
in the main process and before anything is taken, for

* its KV: the capacity its caches may reach, in positions, times the bytes one position takes in every layer
  this verifier holds. shared/model/kv_cache.py makes a cache's capacity a function of the furthest position
  it was asked to hold (never of the order of the requests), so the charge, planned from the frames admitted,
  is an upper bound of what the caches allocate whichever items succeed. In the static KV layout
  (Settings.kv_layout, shared/model/static_kv.py) a session holds a preallocated slot of the whole context
  from its open (a fork too): it is charged that slot whole, and never grows;
* its queue: the bytes of the rows its queued items keep alive (their tensors' storage).

A device (a token subject; with auth off, a connection) may hold `Settings.device_kv_bytes` of KV and
`device_queued_bytes` of queued rows; every device together `kv_bytes_total` and `queued_bytes_total`.
Opening or forking a session, and admitting a prefill or verify frame, are checked here; over a budget the
request is refused (KV_BUDGET, QUEUE_BUDGET) with the budget's name and the numbers, and nothing is taken.
Charges end with the session (closed, or its connection gone) and, for queued rows, when the item leaves the
queue.

Admission also refuses a frame that can never run, before it is queued: rows past the context length, or a
start past the most positions the session can hold when the frame's turn comes (`Session.kv_end`, an upper
bound: a refusal here is certain, the exact check stays with the runner).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from services.verifier_cloud.session import Session
from services.verifier_cloud.settings import Settings
from services.verifier_cloud.token_mode import TokenModel
from services.verifier_cloud.work import EngineError, ErrorKind, WorkKind
from services.verifier_cloud.work_item import WorkItem
from shared.model.checkpoint import read_config
from shared.model.invariant_attention import padded_length
from shared.model.kv_cache import MIN_CAPACITY, SessionKV, fork_capacity, grown_capacity
from shared.model.split import MiddleSubmodel


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


@dataclass(frozen=True)
class Admission:
    """What admitting one item will charge its session (applied once the item is queued)."""

    kv_end: int
    kv_capacity: int
    queued_bytes: int

    def apply(self, session: Session, item: WorkItem) -> None:
        session.kv_end, session.kv_capacity = self.kv_end, self.kv_capacity
        session.queued_bytes += self.queued_bytes
        item.queued_bytes = self.queued_bytes


def held_bytes(item: WorkItem) -> int:
    """The bytes a queued item keeps alive: the storage behind its rows (a decoded frame's, when they view it)."""
    return sum(t.untyped_storage().nbytes() for t in (item.hidden, item.token_ids) if t is not None)


class Budgets:
    def __init__(
        self,
        settings: Settings,
        context_length: int,
        kv_bytes_per_position: int,
        token_kv_bytes_per_position: int | None,
        device_of: Callable[[object], object],
        sessions: Callable[[], Iterable[Session]],
        static_capacity: int | None = None,
    ) -> None:
        """`kv_bytes_per_position`: one position of a session's KV in every layer held here;
        `token_kv_bytes_per_position`: the same for token sessions (None: no token mode);
        `device_of(owner)`: whom a session counts toward; `sessions()`: the open sessions;
        `static_capacity`: the static KV layout's slot, in positions, which every session (a fork too) holds
        whole from its open to its close (None: the growable layout, charged as far as it may grow)."""
        self.static_capacity = static_capacity
        self.settings = settings
        self.context_length = context_length
        self.kv_bytes_per_position = kv_bytes_per_position
        self.token_kv_bytes_per_position = token_kv_bytes_per_position or kv_bytes_per_position
        self.device_of = device_of
        self.sessions = sessions

    # -- what is held -------------------------------------------------------------------
    def kv_charge(self, session: Session, capacity: int | None = None) -> int:
        """Bytes of KV charged for `session` at `capacity` positions (default: what it holds now)."""
        per_position = self.token_kv_bytes_per_position if session.is_token else self.kv_bytes_per_position
        return (session.kv_capacity if capacity is None else capacity) * per_position

    def kv_bytes(self, device: object | None = None) -> int:
        """KV charged to `device`'s sessions (None: every session's)."""
        return sum(self.kv_charge(s) for s in self._of(device))

    def queued_bytes(self, device: object | None = None) -> int:
        return sum(s.queued_bytes for s in self._of(device))

    def _of(self, device: object | None) -> list[Session]:
        return [s for s in self.sessions() if device is None or self.device_of(s.owner) == device]

    # -- checks -------------------------------------------------------------------------------
    def _check(
        self, kind: ErrorKind, what: str, session: Session, more: int, held_by: Callable[[object | None], int]
    ) -> None:
        """Refuse `more` bytes for `session` if its device's, or every device's, budget would pass."""
        if more <= 0:
            return
        device = self.device_of(session.owner)
        per_device, total = (
            (self.settings.device_kv_bytes, self.settings.kv_bytes_total)
            if kind is ErrorKind.KV_BUDGET
            else (self.settings.device_queued_bytes, self.settings.queued_bytes_total)
        )
        name = "kv_bytes" if kind is ErrorKind.KV_BUDGET else "queued_bytes"
        for scope, held, budget, setting in (
            ("this device's sessions", held_by(device), per_device, f"{name}_per_device"),
            ("all sessions", held_by(None), total, f"{name}_total"),
        ):
            if held + more > budget:
                raise EngineError(
                    kind,
                    f"{what} needs {more} bytes ({mib(more)}) more; {scope} hold {held} ({mib(held)}) "
                    f"and the budget {setting} is {budget} ({mib(budget)})",
                    session.session_id,
                )

    def open(self, session: Session) -> None:
        """A fresh session: charge its first caches (raises KV_BUDGET)."""
        self._check(
            ErrorKind.KV_BUDGET, "a new session's KV", session, self.kv_charge(session, self._first()), self.kv_bytes
        )
        session.kv_capacity, session.kv_end = self._first(), 0

    def _first(self, fork_of: int | None = None) -> int:
        """The capacity a session's caches start with: its static slot, or a fresh (fork's) growable cache."""
        if self.static_capacity is not None:
            return self.static_capacity
        return MIN_CAPACITY if fork_of is None else fork_capacity(fork_of)

    def fork(self, session: Session, parent: Session, length: int | None) -> int:
        """A fork of `length` (None: all) of `parent`'s positions: charge its copy (raises BAD_SHAPE,
        KV_BUDGET); returns the positions it holds at most (the copy's own check is the runner's)."""
        bound = parent.kv_end if length is None else length
        if not 0 <= bound <= parent.kv_end:
            raise EngineError(
                ErrorKind.BAD_SHAPE,
                f"fork of {length} positions; the parent holds at most {parent.kv_end}",
                session.session_id,
            )
        capacity = self._first(bound)
        self._check(
            ErrorKind.KV_BUDGET,
            f"a fork of {bound} positions",
            session,
            self.kv_charge(session, capacity),
            self.kv_bytes,
        )
        session.kv_capacity, session.kv_end = capacity, bound
        return bound

    def admit(self, item: WorkItem, session: Session) -> Admission:
        """Whether `item` may be queued on `session`: refusals for a frame that can never run (BAD_SHAPE,
        MALFORMED), KV growth past a budget (KV_BUDGET), queued rows past one (QUEUE_BUDGET)."""
        position, rows = item.position, item.num_tokens
        refusal: tuple[ErrorKind, str] | None = None
        if item.kind is WorkKind.PREFILL and position > session.kv_end:
            refusal = ErrorKind.MALFORMED, f"chunk starts at {position}, session holds at most {session.kv_end}"
        elif item.kind is WorkKind.VERIFY and not 0 <= position <= session.kv_end:
            refusal = (
                ErrorKind.MALFORMED,
                f"commit_len {position} beyond the {session.kv_end} positions the session may hold",
            )
        elif position + rows > self.context_length:
            refusal = ErrorKind.BAD_SHAPE, f"session would exceed the context length {self.context_length}"
        if refusal is not None:  # raised unnamed: an error held in a local would keep this frame (and its rows)
            raise EngineError(*refusal, item.session_id, item.seq_no)  # alive in a cycle until the next gc
        end = position + rows
        reach = padded_length(end)  # attention reserves rows up to the padded width (invariant_attention.py)
        # a static slot never grows (the context length, refused above, bounds it); a growable cache doubles
        grows = reach > session.kv_capacity and self.static_capacity is None
        capacity = grown_capacity(reach) if grows else session.kv_capacity
        queued = held_bytes(item)
        try:
            self._check(
                ErrorKind.KV_BUDGET,
                f"growing the KV to {capacity} positions",
                session,
                self.kv_charge(session, capacity) - self.kv_charge(session),
                self.kv_bytes,
            )
            self._check(ErrorKind.QUEUE_BUDGET, "queueing this frame", session, queued, self.queued_bytes)
        except EngineError as exc:
            exc.seq_no = item.seq_no
            raise
        return Admission(max(session.kv_end, end), capacity, queued)


def kv_bytes_per_position(
    settings: Settings, middle: MiddleSubmodel | None, token_model: TokenModel | None
) -> tuple[int, int | None]:
    """KV bytes one position takes in every layer this verifier holds: (a session's, a token session's or
    None without token mode). With stage workers (no `middle` here) from the config, at 4 bytes an element."""
    if middle is not None:
        per_position = bytes_per_position(middle.new_cache())
        lower = token_model.lower.new_cache() if token_model is not None else None
        return per_position, None if lower is None else per_position + bytes_per_position(lower)
    config = read_config(Path(settings.model_dir))
    layers = config["num_hidden_layers"] - settings.split_layers
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return layers * 2 * kv_heads * head_dim * 4, None


def bytes_per_position(cache: SessionKV) -> int:
    """KV bytes per position of a fresh cache (every layer, keys and values)."""
    per_position = cache.nbytes() // MIN_CAPACITY
    cache.free()
    return per_position
