"""The segment that holds an engine, seen from Python.

This is the only module that knows where things are in the segment: it asks
the C ring for each region's offset (csrc/ring.h draws the layout) and builds
the numpy views of the input and output regions over them. It also decides
keeps the settings' JSON copy (engine.config) in the segment's header;
whether a segment fits /dev/shm is engine.shm.sizing's.
"""
import fcntl
import mmap
import os
import secrets
import threading

import numpy as np
import posix_ipc

from engine.config import NAME_RE, EngineConfig
from engine.errors import (
    EngineAlreadyRunning,
    EngineCorrupt,
    EngineUnavailable,
    SegmentTooLarge,
)
from engine.shm import codes, liveness, ring, sizing
from engine.shm.sizing import size_text


UNSERVED_WORD = codes.W_UNSERVED_UNTIL_NS - codes.WORDS  # its index in Segment.words2


def segment_name(name: str) -> str:
    return f"/shmbatch-{name}"


def settings(mapping, where: str) -> EngineConfig:
    """The engine's settings, as its creator wrote them into the header;
    EngineCorrupt if they no longer parse."""
    blob = bytes(mapping[codes.OFF_CONFIG:codes.OFF_CONFIG + codes.CONFIG_BYTES]).rstrip(b"\0")
    try:
        return EngineConfig.from_json(blob)
    except Exception as e:  # any way bytes fail to be settings: JSON, UTF-8, a knob's check
        raise EngineCorrupt(f"{where}: expected the engine's settings as JSON in its header, "
                            f"got {len(blob)} B that do not parse ({type(e).__name__}: "
                            f"{str(e)[:120]})") from None


def check_geometry(cfg: EngineConfig, geo, where: str) -> None:
    """EngineCorrupt unless the settings and the checked geometry agree:
    the views made from one must fit the rows the C addresses by the other."""
    n_in = len(cfg.slot_input_specs)
    expected = {"capacity": cfg.queue_capacity, "levels": cfg.priority_levels,
                "max_batch": cfg.max_batch_size, "inputs": n_in,
                "tensors": n_in + len(cfg.output_specs) + len(cfg.hidden_output_specs),
                "in_place": int(cfg.in_place),
                "steps": cfg.steps}
    got = {k: getattr(geo, k) for k in expected}
    rows = [int(geo.tensor_slot_bytes[t]) for t in range(geo.tensors)]
    if got != expected or rows != [int(b) for b in cfg.slot_bytes]:
        raise EngineCorrupt(f"{where}: expected a geometry of {expected}, rows {list(cfg.slot_bytes)} "
                            f"B (its settings), got {got}, rows {rows} B")


class Segment:
    """One mapping of an engine's segment: ring, settings, region views.

    The creator holds an exclusive flock(2) on the segment for as long as the
    engine lives; the kernel drops it when that process dies, however it dies.
    A live lock is how anyone tells a running engine from a crashed one.
    """

    def __init__(self, shm, mapping, owner: bool, header_only: bool = False, created=None):
        self._shm = shm
        self._mapping = mapping
        self.owner = owner
        self.header_only = header_only  # the header page alone: figures and lock, no slots
        self._owned = {}  # the words only the creator writes, as it last wrote them (own_word)
        self._owned_lock = threading.Lock()  # a restore never writes back a value just replaced
        self._settings = None  # the settings as the header holds them (restore)
        if created is not None:  # the creator's own geometry, from its sb_init
            self.ring = created
        else:
            self.ring = ring.Ring(mapping)
            size = mapping.size()
            code = (self.ring.attach_header if header_only else self.ring.attach)(size)
            if code != codes.OK:
                self._close_mapping()
                if code == codes.EVERSION:
                    raise EngineUnavailable(f"{shm.name} is not a shmbatch segment of layout "
                                            f"version {codes.LAYOUT_VERSION}")
                raise EngineCorrupt(f"{shm.name}: expected a shmbatch header whose geometry "
                                    f"fits its {size:,} B, got one that does not")
        geo = self.ring.geometry
        try:
            self.config = settings(mapping, shm.name)
            if not header_only:
                check_geometry(self.config, geo, shm.name)
        except EngineCorrupt:
            self._close_mapping()
            raise
        self.capacity = geo.capacity
        self.incarnation = geo.incarnation
        self.total_bytes = geo.total_bytes
        # the header's words (W_*) for plain loads and stores: the engine's state
        # read per request, a batch's start stamped per batch, without a C call
        # (one would let another thread take the GIL). Ordered and atomic updates
        # go through the ring (word, set_word, add_word).
        self.words = self.ring.header_words()
        self.words2 = self.ring.header_words2()  # W_* from codes.WORDS on, at [W - WORDS]
        if header_only:
            return
        cfg = self.config
        # one region per tensor, inputs first: [capacity, *max_shape] of its dtype
        regions = [np.ndarray((self.capacity, *t.max_shape), t.dtype, buffer=mapping,
                              offset=geo.off_tensor[k])
                   for k, t in enumerate(cfg.slot_input_specs + cfg.output_specs
                                         + cfg.hidden_output_specs)]
        n_in = len(cfg.slot_input_specs)
        n_model, n_out = len(cfg.input_specs), n_in + len(cfg.output_specs)
        self.in_regions, self.out_regions = regions[:n_model], regions[n_in:n_out]  # spec order
        # a prompt_logprobs engine's: (values [L, 1 + K] float32, ids [L, K] int32) per slot,
        # written by the batcher at join; None without
        hidden = regions[n_out:]
        self.prompt_regions = ((hidden[0], hidden[1] if len(hidden) > 1 else None)
                               if hidden else None)
        # a sampling engine's: each slot's Sampling record (written by clients: data)
        self.records = regions[n_model] if cfg.sampling else None
        # each input's real length along its variable dim, per slot: written by
        # clients, so the batcher bounds what it reads
        self.lengths = np.ndarray((self.capacity, n_in), np.uint32, buffer=mapping,
                                  offset=geo.off_lengths)
        # the READY bitmaps (a hint for the batcher's scan; the C owns them: for reading)
        self.ready_words = np.ndarray((cfg.priority_levels, geo.ready_words), np.uint64,
                                      buffer=mapping, offset=geo.off_ready)
        # the fused calls: one C call copies a request in (one input of a fixed
        # shape, C-contiguous), one copies its answer out (one output)
        self.fused_in = n_in == 1 and cfg.slot_input_specs[0].var_axis is None
        self.fused_out = len(cfg.output_specs) == 1 and not cfg.iterative
        self.iterative = cfg.iterative  # a step model's engine: answers are chunk streams
        self.steps = cfg.steps  # an iterative engine's chunks per slot (0: one-shot)
        spec = cfg.output_specs[0]
        self.out_shape, self.out_dtype = tuple(spec.shape), np.dtype(spec.dtype)  # the first's
        self.admit_by_deadline = cfg.admission == "deadline"  # read per request
        self.in_place = bool(geo.in_place)  # outputs is inputs

    @classmethod
    def create(cls, config: EngineConfig) -> "Segment":
        """Creates the segment (owner-only) and takes its lock; a crashed
        engine's segment of the same name is removed first (before the size
        check: the space it holds is this engine's to reuse), a live one refused."""
        name = segment_name(config.name)
        n_in = len(config.slot_input_specs)
        size = ring.layout_bytes(config.queue_capacity, n_in, config.slot_bytes,
                                 config.in_place, config.priority_levels, config.steps)
        if size == 0:
            raise ValueError(f"an engine of {config.queue_capacity} slots of "
                             f"{config.input_slot_bytes} B input is too large")
        if len(config.to_json()) > codes.CONFIG_BYTES:
            raise ValueError(f"engine {config.name!r}'s settings take {len(config.to_json())} B "
                             f"as JSON, more than the header's {codes.CONFIG_BYTES} B: fewer or "
                             f"shorter tensor names")
        remove_if_dead(config.name)  # a crash's leftover is not counted as used
        sizing.check_fits(config, size)  # before anything is allocated
        for _ in range(2):
            try:
                shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
                break
            except posix_ipc.ExistentialError:
                remove_if_dead(config.name)
        else:
            raise EngineAlreadyRunning(f"engine {config.name!r} could not be created: "
                                       f"{name} keeps reappearing")
        mapping = raw = None
        try:  # from here, any failure removes what was made before it raises
            fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # commit every page now: a first touch on the request path costs a page
            # allocation per 4 KiB (3.6 ms per 1 MiB request was measured without it);
            # and a /dev/shm that fills up fails here, not as a SIGBUS on some request
            try:
                os.posix_fallocate(shm.fd, 0, size)
            except OSError as e:
                raise SegmentTooLarge(f"engine {config.name!r} could not commit its "
                                      f"{size_text(size)} of shared memory in /dev/shm "
                                      f"({os.strerror(e.errno)}); nothing was left behind") from None
            mapping = _map(shm.fd, size)
            raw = ring.Ring(mapping)
            code = raw.init(size, config.queue_capacity, config.max_batch_size, n_in,
                            config.slot_bytes, config.in_place, config.priority_levels,
                            config.steps, secrets.randbits(64))
            blob = config.to_json()
            if code != codes.OK or len(blob) > codes.CONFIG_BYTES:
                raise ValueError(f"cannot lay out engine {config.name!r} (code {code})")
            mapping[codes.OFF_CONFIG:codes.OFF_CONFIG + len(blob)] = blob
            return cls(shm, mapping, owner=True, created=raw)
        except BaseException:
            if raw is not None:
                raw.release()
            if mapping is not None:
                mapping.close()
            shm.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise

    @classmethod
    def attach(cls, name: str, header_only: bool = False) -> "Segment":
        """Maps a running engine's segment. A dead engine's segment is refused
        before its data regions are mapped (mapping a large leftover would
        commit its memory); header_only maps the header page alone, alive or
        dead: for cleanup and status."""
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(f"name must match [A-Za-z0-9_.-]{{1,64}}, got {name!r}")
        try:
            shm = posix_ipc.SharedMemory(segment_name(name))
        except posix_ipc.ExistentialError:
            raise EngineUnavailable(f"no engine named {name!r} is running "
                                    f"(no /dev/shm{segment_name(name)})") from None
        st = os.fstat(shm.fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            shm.close_fd()
            raise EngineUnavailable(f"/dev/shm{segment_name(name)} is not owner-only "
                                    f"(uid {st.st_uid}, mode {st.st_mode & 0o777:o})")
        if st.st_size < codes.HEADER_BYTES:
            shm.close_fd()
            raise EngineUnavailable(f"engine {name!r} is not initialised yet")
        if header_only:
            mapping = mmap.mmap(shm.fd, codes.HEADER_BYTES, flags=mmap.MAP_SHARED)
        elif not _locked(shm.fd):
            shm.close_fd()
            raise EngineUnavailable(f"engine {name!r} is not running (/dev/shm"
                                    f"{segment_name(name)} is left by an engine that died: "
                                    f"`shmbatch cleanup {name}` removes it)")
        else:
            mapping = _map(shm.fd, st.st_size)
        try:
            return cls(shm, mapping, owner=False, header_only=header_only)
        except EngineUnavailable:
            shm.close_fd()
            raise

    # -- state -------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def closed(self) -> bool:
        return self._shm is None

    def engine_state(self) -> int:
        return self.words[codes.W_ENGINE_STATE]

    def epoch(self) -> int:
        """The epoch whose batchers serve (a reload moves it on; see batcher.run)."""
        return self.words[codes.W_EPOCH]

    def mark_batch(self, instance: int, claim_ns: int) -> None:
        """Says when the batch that batcher `instance` serves was claimed (0:
        none), for the supervisor's watchdog; a plain aligned store, no C call."""
        self.words[codes.W_BATCH_START + instance] = claim_ns

    def set_batch_limit(self, limit: int) -> None:
        self.words[codes.W_BATCH_LIMIT] = limit

    def batch_limit(self) -> int:
        """The batchers' current batch limit (0 before the engine sets it)."""
        return self.words[codes.W_BATCH_LIMIT]

    def unserved_until_ns(self) -> int:
        """0 while a batcher serves; else when the restart in progress is
        expected to have one serving (engine.serving.restarts.Unserved)."""
        return self.words2[UNSERVED_WORD]

    def batch_started_ns(self, instance: int) -> int:
        return self.words[codes.W_BATCH_START + instance]

    def own_word(self, word: int, value: int) -> None:
        """Sets a header word that only the creator writes, and remembers it
        for restore()."""
        with self._owned_lock:
            self._owned[word] = value
            self.ring.set_word(word, value)

    def restore(self) -> int:
        """The creator puts back what it alone writes, wherever another process
        wrote over it: the header's geometry, the settings and its own words
        (the engine's state, epoch, instances, its pid). Returns how many
        values had changed. Slot fields are not restored: each is checked
        where it is used, and rewritten at the slot's next use."""
        changed = self.ring.restore_header()
        if self._settings is None:  # serialised once: this runs on every supervisor pass
            self._settings = self.config.to_json().ljust(codes.CONFIG_BYTES, b"\0")
        blob = self._settings
        if self._mapping[codes.OFF_CONFIG:codes.OFF_CONFIG + codes.CONFIG_BYTES] != blob:
            self._mapping[codes.OFF_CONFIG:codes.OFF_CONFIG + codes.CONFIG_BYTES] = blob
            changed += 1
        with self._owned_lock:
            for word, value in self._owned.items():
                if self.ring.word(word) != value:
                    self.ring.set_word(word, value)
                    changed += 1
        return changed

    def holder_alive(self) -> bool:
        """True while the engine that created the segment holds its lock."""
        return self.owner or _locked(self._shm.fd)

    def serves(self) -> bool:
        """Whether the engine serves now: it runs, and at least one of its
        batchers lives and has loaded its model. A batcher registers its pid
        only once its factory ran, and the supervisor zeroes the word when it
        reaps a dead one; a pid is judged with its start time (engine.shm.
        liveness). Both banks of batcher numbers are read: a reload's new
        batchers register in the other. Readiness, for HTTP and `status --ready`."""
        if self.engine_state() != codes.ENGINE_RUNNING or not self.holder_alive():
            return False
        words = self.words
        for i in range(min(2 * self.config.instances, codes.MAX_INSTANCES)):
            pid = int(words[codes.W_BATCHER_PID + i])
            if pid and liveness.is_alive(pid, int(words[codes.W_BATCHER_START + i])):
                return True
        return False

    # -- teardown ------------------------------------------------------------
    def _close_mapping(self) -> None:
        self.ring.release()
        try:
            self._mapping.close()
        except BufferError:  # a view is still held (e.g. by a backend): leave it mapped
            pass

    def close(self) -> None:
        """Unmaps (views must be dropped first) and closes the fd (and its lock)."""
        if self._shm is None:
            return
        self.in_regions = self.out_regions = self.words = self.words2 = self.records = None
        self.prompt_regions = None
        self.ready_words = self.lengths = None
        self._close_mapping()
        self._shm.close_fd()
        self._shm = None

    def unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory(segment_name(self.config.name))
        except posix_ipc.ExistentialError:
            pass


def _locked(fd: int) -> bool:
    """Whether a live process holds the segment's exclusive lock (its engine)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _map(fd: int, size: int) -> mmap.mmap:
    """Maps the segment with its page tables filled in up front (MAP_POPULATE),
    so no request pays a page fault in this process."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)


def _names(name: str, st) -> bool:
    """Whether the engine's segment name still names the file of stat st."""
    try:
        now = os.stat(f"{sizing.SHM_DIR}{segment_name(name)}")
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)


def remove_if_dead(name: str) -> bool:
    """Unlinks the segment of a crashed engine; EngineAlreadyRunning if it lives.
    Returns whether there was one."""
    try:
        shm = posix_ipc.SharedMemory(segment_name(name))
    except posix_ipc.ExistentialError:
        return False
    try:
        fcntl.flock(shm.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        # unlinked while the lock is held, and only if the name still names the
        # file locked: another starter may have removed it and made its own
        if _names(name, os.fstat(shm.fd)):
            try:
                posix_ipc.unlink_shared_memory(segment_name(name))
            except posix_ipc.ExistentialError:
                pass
    except BlockingIOError:
        raise EngineAlreadyRunning(f"engine {name!r} is already running "
                                   f"(/dev/shm{segment_name(name)} is locked by a live process)") from None
    finally:
        shm.close_fd()
    return True
