"""The constants of csrc/ring.h, by name and without their SB_ prefix.

Each is read from the compiled module, so Python and C cannot disagree; the
groups follow the header, which says what each means.
"""
from engine._ringc import lib

LAYOUT_VERSION = lib.SB_LAYOUT_VERSION
HEADER_BYTES = lib.SB_HEADER_BYTES
CONFIG_BYTES = lib.SB_CONFIG_BYTES
OFF_CONFIG = lib.SB_OFF_CONFIG
OFF_WORDS = lib.SB_OFF_WORDS
ERRMSG_BYTES = lib.SB_ERRMSG_BYTES
MAX_CAPACITY = lib.SB_MAX_CAPACITY
MAX_INSTANCES = lib.SB_MAX_INSTANCES
MAX_PRIORITIES = lib.SB_MAX_PRIORITIES
MAX_TENSORS = lib.SB_MAX_TENSORS
MAX_BUCKETS = lib.SB_MAX_BUCKETS
MAX_TAKE = lib.SB_MAX_TAKE
HIST_BUCKETS = lib.SB_HIST_BUCKETS
MAX_STEPS = lib.SB_MAX_STEPS
CHUNKS_END = lib.SB_CHUNKS_END
CHUNKS_STOP = lib.SB_CHUNKS_STOP
CHUNKS_LIMIT = lib.SB_CHUNKS_LIMIT
CHUNKS_COUNT = lib.SB_CHUNKS_COUNT

# the control word's fields (drawn in ring.h) that Python reads too
STATE_MASK = lib.SB_STATE_MASK
PID_SHIFT = lib.SB_PID_SHIFT
PID_MASK = lib.SB_PID_MASK

# slot states (ctl bits 0-3)
FREE = lib.SB_FREE
WRITING = lib.SB_WRITING
READY = lib.SB_READY
CLAIMED = lib.SB_CLAIMED
DONE = lib.SB_DONE
FAILED = lib.SB_FAILED
ABANDONED = lib.SB_ABANDONED

# results
OK = lib.SB_OK
EFULL = lib.SB_EFULL
ESTALE = lib.SB_ESTALE
ETIMEOUT = lib.SB_ETIMEOUT
EBADARG = lib.SB_EBADARG
ECORRUPT = lib.SB_ECORRUPT
EVERSION = lib.SB_EVERSION
EBUSY = lib.SB_EBUSY
EFAILED = lib.SB_EFAILED
EOVERLOADED = lib.SB_EOVERLOADED

# words[]: identities and counters, all u64
W_ENGINE_STATE = lib.SB_W_ENGINE_STATE
W_SUPERVISOR_PID = lib.SB_W_SUPERVISOR_PID
W_SUPERVISOR_START = lib.SB_W_SUPERVISOR_START
W_INSTANCES = lib.SB_W_INSTANCES
W_EPOCH = lib.SB_W_EPOCH
W_TOKENS = lib.SB_W_TOKENS
W_PADDED_TOKENS = lib.SB_W_PADDED_TOKENS
W_RETRIED = lib.SB_W_RETRIED
W_REQUESTS = lib.SB_W_REQUESTS
W_REJECTED = lib.SB_W_REJECTED
W_TIMEOUTS = lib.SB_W_TIMEOUTS
W_ERRORS = lib.SB_W_ERRORS
W_ANSWERED = lib.SB_W_ANSWERED
W_BATCHES = lib.SB_W_BATCHES
W_ITEMS = lib.SB_W_ITEMS
W_ZERO_COPY = lib.SB_W_ZERO_COPY
W_GATHERED = lib.SB_W_GATHERED
W_RECLAIMED = lib.SB_W_RECLAIMED
W_STALE = lib.SB_W_STALE
W_RESTARTS = lib.SB_W_RESTARTS
W_QUEUE_WAIT_MAX_NS = lib.SB_W_QUEUE_WAIT_MAX_NS
W_SERVICE_MAX_NS = lib.SB_W_SERVICE_MAX_NS
W_INVALID = lib.SB_W_INVALID
W_QUEUE_WAIT_SUM_NS = lib.SB_W_QUEUE_WAIT_SUM_NS
W_SERVICE_SUM_NS = lib.SB_W_SERVICE_SUM_NS
W_EXPIRED = lib.SB_W_EXPIRED
W_OVERLOADED = lib.SB_W_OVERLOADED
W_ISOLATED = lib.SB_W_ISOLATED
W_BATCH_LIMIT = lib.SB_W_BATCH_LIMIT
W_FIT_FIXED_NS = lib.SB_W_FIT_FIXED_NS
W_FIT_ITEM_PS = lib.SB_W_FIT_ITEM_PS
W_RETRY_CALLS = lib.SB_W_RETRY_CALLS
W_BATCH_START = lib.SB_W_BATCH_START
W_BATCHER_PID = lib.SB_W_BATCHER_PID
W_BATCHER_START = lib.SB_W_BATCHER_START
WORDS = lib.SB_WORDS
ENGINE_STARTING = lib.SB_ENGINE_STARTING
ENGINE_RUNNING = lib.SB_ENGINE_RUNNING
ENGINE_STOPPING = lib.SB_ENGINE_STOPPING
ENGINE_STOPPED = lib.SB_ENGINE_STOPPED

# histograms
H_QUEUE_WAIT = lib.SB_H_QUEUE_WAIT
H_SERVICE = lib.SB_H_SERVICE
H_BATCH_SIZE = lib.SB_H_BATCH_SIZE
H_TTFT = lib.SB_H_TTFT
H_CHUNK = lib.SB_H_CHUNK

# error status of a FAILED slot
STATUS_OK = lib.SB_STATUS_OK
STATUS_BACKEND = lib.SB_STATUS_BACKEND
STATUS_BATCHER_DIED = lib.SB_STATUS_BATCHER_DIED
STATUS_EXPIRED = lib.SB_STATUS_EXPIRED
STATUS_CORRUPT = lib.SB_STATUS_CORRUPT
T_ARRIVAL = lib.SB_T_ARRIVAL
T_CLAIM = lib.SB_T_CLAIM
T_DONE = lib.SB_T_DONE

# bulk: n requests in one call each (same real length), for Client.infer_many

# waits and wakes (wait.c)

# requests settled outside a finished batch: their async waiters are woken

# admission (admission.c)

# the figures admission reads, in one call: out[SB_A_*]
A_QUEUED = lib.SB_A_QUEUED
A_FIXED_NS = lib.SB_A_FIXED_NS
A_ITEM_PS = lib.SB_A_ITEM_PS
A_LIMIT = lib.SB_A_LIMIT
A_BUSY_SINCE = lib.SB_A_BUSY_SINCE
FIT_MEMORY = lib.SB_FIT_MEMORY
FIT_OUTLIER = lib.SB_FIT_OUTLIER
FIT_REFIT = lib.SB_FIT_REFIT

# adds a batch; 1 when the fit was solved anew

# batcher: the claim (claim.c)
R_CLAIM_NS = lib.SB_R_CLAIM_NS
R_READY = lib.SB_R_READY
R_OLDEST_NS = lib.SB_R_OLDEST_NS
R_EXPIRED = lib.SB_R_EXPIRED
R_BUCKET = lib.SB_R_BUCKET

# batcher: answers (complete.c)

# figures (stats.c)

# the queue wait of one priority level: histogram, sum and max (ns)

# the lowest value (ns) that lands in a time histogram's bucket

# the sum and maximum (ns) of SB_H_TTFT's or SB_H_CHUNK's times

# reaper (reap.c): the supervisor, and a client making room
