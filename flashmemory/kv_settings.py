"""KVSettings: every setting of the KV hierarchy, declared once with its Setting (help, unit,
bounds, flag). EngineConfig includes them as its "KV hierarchy" fields; the cache's
TieredCacheConfig extends them with what start-up derives (geometry, slot counts, device), so a
cache built without the engine (tests, MATS) runs the product's defaults too. Stdlib only."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from flashmemory.errors import ConfigError
from flashmemory.settings import check_settings, setting

MIB = 2**20
REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
NAMESPACE_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def redacted_url(url: str) -> str:
    """A URL with its password (if any) replaced, for messages and logs."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


@dataclass
class KVSettings:
    """The KV-hierarchy settings (DESIGN.md section 2), each with its help and bounds."""

    kv_cache: str = setting(
        "tiered", "tiered (L0/L1/L2 hierarchy) or contiguous (exact baseline, one tensor per "
        "sequence)", choices=("tiered", "contiguous"))
    kv_precision: str = setting(
        "mixed", "bits per level: mixed (INT4 L0 / FP16 L1 / INT4 L2; int4 is the same), "
        "int2-disk (INT4 / FP16 / INT2: the seeds' hierarchy, half the disk, the most loss at "
        "32K: docs/long/README.md) or fp16 (none)", choices=("mixed", "int4", "int2-disk", "fp16"))
    kv_quant_range: str = setting(
        "mse", "range of each INT4/INT2 group (same stored format): mse (min/max shrunk toward "
        "its middle by the factor with the least squared error; outliers clamp), mse-values "
        "(values so, keys min/max) or minmax (every value inside the range)",
        choices=("mse", "mse-values", "minmax"))
    max_gpu_memory_mb: int | None = setting(
        None, "device budget for weights + workspace + L0 KV; None = size L0 for max_num_seqs",
        unit="MiB", ge=1)
    active_window: int = setting(2048, "newest tokens kept in L0", unit="tokens", ge=1)
    recent_fp16_tokens: int = setting(
        128, "newest full-block tokens a forward attends in FP16 (kept with the still-filling "
        "block and the attention-sink block in device memory) instead of through their INT4 L0 "
        "copies; at most active_window; 0 = only the filling block is FP16", unit="tokens", ge=0)
    warm_tokens: int = setting(
        16384, "tokens after the window kept in L1 (host) before moving to L2 (disk)",
        unit="tokens", ge=0)
    semantic_truncate_threshold: float = setting(
        0.15, "fraction of L2 blocks a decode step attends (query-aware)",
        unit="fraction", gt=0, le=1)
    warm_budget_tokens: int = setting(
        1408, "tokens of L1 blocks a decode step attends (query-aware)", unit="tokens", ge=1)
    warm_budget_fraction: float = setting(
        0.25, "most of L1's blocks a decode step attends, as a fraction of them (query-aware): a "
        "short history's L1 is not read almost whole; warm_budget_tokens caps it at long ones",
        unit="fraction", gt=0, le=1)
    selection_min_tokens: int = setting(
        256, "fewest tokens a decode step reads from each of L1 and L2 when it selects (a floor "
        "under warm_budget_tokens and semantic_truncate_threshold; short histories otherwise "
        "read a few blocks)", unit="tokens", ge=0)
    selection_box_tokens: int = setting(
        4, "keys per min/max box of a block's selection digest: a block scores as its best box "
        "(a tighter bound than one box over the block; the digests, kept in host memory, grow "
        "with the boxes: 4-key boxes take about a quarter of the FP16 KV's bytes); 0 = one box "
        "per block; must divide block_size", unit="tokens", ge=0)
    selection_rescore_factor: float = setting(
        1.0, "L1 blocks a decode step scores from their FP16 keys per block it reads: the bounds "
        "pick this many times the budget, the keys' attention mass picks the budget among them "
        "(a two-pass read: the keys of the extra blocks are read, not their values); 1 = the "
        "bounds alone pick", unit="ratio", ge=1, le=8)
    selection_prompt_tokens: int = setting(
        128, "per layer and KV head, tokens of L1 and of L2 blocks that the prompt's last tokens "
        "point to, read at every decode step of the answer (within the budget; 0 = off)",
        unit="tokens", ge=0)
    cpu_memory_gb: float | None = setting(
        None, "L1 host pool capacity; None = 4 GiB, or half the available RAM when that is less "
        "(a value you set above the available RAM is refused at start-up)", unit="GiB", gt=0)
    lock_host_memory: bool = setting(
        False, "lock the host KV level (L1) in RAM with mlock, so it is never swapped out (the "
        "seeds' --disable-swap): the whole pool is committed at start-up, which refuses a pool "
        "over RLIMIT_MEMLOCK with both numbers and the fix (ulimit -l, a lower cpu_memory_gb)",
        flags=("--lock-host-memory", "--disable-swap"))
    cold_zone_enabled: bool = setting(
        True, "an L2 level on disk for KV older than the warm tokens; off (--no-cold-zone) keeps "
        "all older KV in L1 (and says so when L1 is full)", flags=("--no-cold-zone",))
    cold_zone_dir: str | None = setting(
        None, "folder of the L2 file; None = a private folder under ~/.cache/flashmemory/cold "
        "(FLASHMEMORY_CACHE_DIR)")
    cold_zone_gb: float | None = setting(
        None, "L2 file capacity (sparse: disk is used only as blocks are written); None = 16 "
        "GiB, or half the free disk of cold_zone_dir when that is less (a value you set above "
        "the free disk is refused at start-up)", unit="GiB", gt=0)
    kv_levels: str = setting(
        "", "the KV levels in order, comma-separated storage media (kvcache/levels/registry.py): "
        "empty = device_memory,host_memory,disk_file (L2 only with the cold zone), sized by "
        "max_gpu_memory_mb, cpu_memory_gb and cold_zone_gb; each level after those is "
        "MEDIUM:MIB:PRECISION:AFTER_TOKENS (PRECISION fp16, int4 or int2): blocks move to it "
        "AFTER_TOKENS after they reached the level before")
    # NOTE: "auto" is resolved (EngineConfig.resolve_block_size) before the cache's config gets it.
    block_size: int | str = setting(
        16, "tokens per KV block; auto grows with max_seq_len (16 up to 8K, 32 up to 32K, else "
        "64)", unit="tokens", choices=("auto", 8, 16, 32, 64, 128))
    prefill_chunk_tokens: int = setting(
        512, "prompt tokens per forward during prefill (bounds activation memory)",
        unit="tokens", ge=1)
    selection: str = setting(
        "quest", "quest (attend the blocks the query needs) or exact (attend all)",
        choices=("quest", "exact"))
    max_num_seqs: int = setting(
        4, "sequences alive at once (each holds its newest tokens unquantized in device memory: "
        "the still-filling block and recent_fp16_tokens)", ge=1)
    record_traces: bool = setting(
        False, "keep every decode step's block choices (per layer, KV head) for predictor "
        "training")
    prefetch_strategy: str = setting(
        "none", "read predicted-hot L2 blocks ahead of need: none, adaptive (depth follows hit "
        "rate) or aggressive", choices=("none", "adaptive", "aggressive"))
    prefetch_ranker: str = setting(
        "predictor", "what ranks blocks to prefetch: predictor (heat MLP) or lru (recency)",
        choices=("predictor", "lru"))
    prefetch_budget_mb: float = setting(
        64.0, "host memory for prefetched L2 blocks (the staging area)", unit="MiB", gt=0)
    heat_predictor_path: str | None = setting(
        None, "trained heat-predictor weights (.npz); None = the shipped ones")
    cold_zone_uncached_reads: bool = setting(
        False, "drop L2 pages from the OS page cache after each read (honest disk I/O)")
    # NOTE: for GPU hosts; on a CPU host L1 is the compute's memory already: staging adds copies.
    device_staging_mb: float = setting(
        0.0, "device memory (counted in max_gpu_memory_mb) for L1 blocks the prefetcher copies "
        "ahead of the step that reads them; 0 = off; needs a prefetch_strategy", unit="MiB", ge=0)
    prefix_caching: bool = setting(
        True, "name full KV blocks by their tokens and keep them after a request ends, so a "
        "later prompt that starts the same (a chat's history, a document asked again) reuses "
        "them instead of prefilling again; off (--no-prefix-caching) frees every block as its "
        "request ends", flags=("--no-prefix-caching",))
    prefix_cache_host_mb: float = setting(
        256.0, "host memory the prefix cache may keep for the FP16 copies of blocks no request "
        "uses (an 8K-token SmolLM2 document's are 184 MB), and of live requests' blocks that aged "
        "onto L2 (so the same prompt again reuses them); beyond it the least recently used (a "
        "prefix's tail first) leave L1, written to L2 first when there is one, and a prompt "
        "computes them again where a prefill keeps FP16; 0 = none stay in L1 (a quiet server "
        "then holds only its working set)", unit="MiB", ge=0)
    prefix_cache_disk_mb: float = setting(
        1024.0, "disk (cold zone) the prefix cache may keep for the L2 copies of blocks no "
        "request uses; beyond it the least recently used leave the cache and their slots are "
        "reused first, so the cold-zone file stays near the working set plus this; with "
        "persist_cache, the size of the cache kept across restarts", unit="MiB", ge=0)
    persist_cache: bool = setting(
        False, "keep the prefix cache across restarts: the L2 file and its index stay in "
        "cold_zone_dir (needed: a folder of yours no one else can write) and are recovered at "
        "the next start (another model, precision or block size, or anything failing its checks "
        "or MAC: discarded, docs/prefix_cache.md); off, the cold zone is scratch space removed "
        "at exit")
    attention_backend: str = setting(
        "auto", "decode attention of the tiered cache: auto (the native CPU kernel where it "
        "runs, else torch), native or torch (kvcache/attention/registry.py)",
        choices=("auto", "native", "torch"))
    scheduling_policy: str = setting(
        "fcfs", "who is admitted next and who is preempted first: fcfs (arrival order; the "
        "newest is preempted first) (engine/scheduling_policy.py)", choices=("fcfs",))
    placement_policy: str = setting(
        "age", "where old blocks live: age (by token age: window in L0, warm_tokens in L1, then "
        "the levels below) or locality (the seed's MemScheduler: by age, and blocks selection "
        "keeps choosing get an L0 copy or keep their L1 copy, blocks never chosen leave L1 "
        "early; kvcache/manager/policy.py, docs/placement.md)", choices=("age", "locality"))
    locality_device_tokens: int = setting(
        256, "placement_policy=locality: tokens of old blocks a sequence may hold in L0 by "
        "locality (device bytes traded for reads: the seed's cost sensitivity), counted in the "
        "device budget", unit="tokens", ge=0)
    locality_host_tokens: int = setting(
        2048, "placement_policy=locality: tokens a sequence may keep in L1 past warm_tokens by "
        "locality (as many sink early to the level below)", unit="tokens", ge=0)
    locality_history_steps: int = setting(
        100, "placement_policy=locality: decode steps a block's access-locality index looks "
        "back over (the seed's last 100 accesses)", unit="steps", ge=1)
    budget_controller: bool = setting(
        False, "move the L0 budget at run time by device utilization (NVML on a GPU, the engine "
        "thread's busy fraction on a CPU): under 30 % for 30 s -10 %; over 85 % for 10 s while "
        "L0 serves under 95 % of decode block reads +5 % (engine/budget_controller.py); never "
        "above the L0 pool sized at start-up")
    budget_controller_min_fraction: float = setting(
        0.5, "lowest L0 budget the budget controller may set, as a fraction of the L0 pool sized "
        "at start-up (never below one sequence's window)", unit="fraction", gt=0, le=1)
    remote_kv_url: str | None = setting(
        None, "redis://[:PASSWORD@]HOST:PORT[/DB] (or rediss://, unix://) of a KV level every "
        "replica shares: full blocks a prefill computed are published there, and a prompt's "
        "blocks missing here are read from it before they would be computed "
        "(kvcache/remote/, docs/cluster.md); None = off")
    remote_kv_namespace: str = setting(
        "default", "replicas that share blocks name the same namespace (in every key: "
        "fm:v1:NAMESPACE:HASH); blocks of another model, precision or block size are never "
        "shared, whatever the namespace")
    remote_kv_ttl_s: int = setting(
        86400, "how long a published block lives in the shared level", unit="s", ge=1)
    remote_kv_max_mb: int | None = setting(
        None, "publish blocks only while Redis' used_memory is under this; None = Redis' own "
        "maxmemory decides (an evicted block is a miss)", unit="MiB", ge=1)
    remote_kv_timeout_ms: float = setting(
        500.0, "longest wait for one round trip to the shared level (a lookup of up to 32 "
        "blocks, a write); after a failure it is left alone for 1 s, doubling to 30 s, and "
        "prompts are computed here", unit="ms", gt=0)
    remote_kv_required: bool = setting(
        False, "refuse to start when remote_kv_url does not answer; off: a warning, and the "
        "local levels alone until it answers")

    def __post_init__(self) -> None:
        check_settings(self, KVSettings)  # types, bounds and choices, as each field's Setting says
        self._check_cross_field()

    def _check_cross_field(self) -> None:
        """The rules that tie two KV settings together (one field's metadata cannot say them)."""
        if self.device_staging_mb != 0 and self.prefetch_strategy == "none":
            raise ConfigError(
                f"device_staging_mb={self.device_staging_mb} needs a prefetcher to fill it: set "
                "prefetch_strategy to 'adaptive' or 'aggressive', or device_staging_mb=0")
        self._check_remote()
        bs = self.block_size
        if isinstance(bs, int) and self.active_window < bs:
            raise ConfigError(
                f"active_window={self.active_window} must be at least block_size={bs}")

    def _check_remote(self) -> None:
        url = self.remote_kv_url
        if url is None:
            return
        if not url.startswith(REMOTE_SCHEMES):
            raise ConfigError(f"remote_kv_url={redacted_url(url)!r} is not a Redis URL: write "
                              "redis://HOST:PORT/DB (rediss:// with TLS, unix:///PATH)")
        if self.kv_cache != "tiered":
            raise ConfigError("remote_kv_url is a level of the tiered cache: set kv_cache='tiered' "
                              "or leave remote_kv_url unset")
        if not NAMESPACE_RE.fullmatch(self.remote_kv_namespace):
            raise ConfigError(f"remote_kv_namespace={self.remote_kv_namespace!r}: use 1-64 "
                              "letters, digits, '.', '_' or '-'")

    @property
    def remote_kv_max_bytes(self) -> int | None:
        """Redis' used_memory under which blocks are published (None: no cap of ours)."""
        return None if self.remote_kv_max_mb is None else int(self.remote_kv_max_mb * MIB)

    # The byte sizes the cache and the sizing work in, from the MiB settings (one fact, one field).
    @property
    def prefetch_budget_bytes(self) -> int:
        """Host bytes of staged (prefetched) L2 segments."""
        return int(self.prefetch_budget_mb * MIB)

    @property
    def device_staging_bytes(self) -> int:
        """Device area for L1 blocks copied ahead of need (0 = off; prefetch/device_staging.py)."""
        return int(self.device_staging_mb * MIB)

    @property
    def prefix_cache_host_bytes(self) -> int:
        """L1 bytes unused cached blocks may keep (the rest go to L2 or leave)."""
        return int(self.prefix_cache_host_mb * MIB)

    @property
    def prefix_cache_disk_bytes(self) -> int:
        """L2 bytes they may keep (beyond it the least recently used leave)."""
        return int(self.prefix_cache_disk_mb * MIB)

    def locality_device_blocks(self, block_size: int) -> int:
        """Old blocks a sequence may hold in L0 by placement by locality (0 under the age rule)."""
        if self.placement_policy != "locality":
            return 0
        return self.locality_device_tokens // block_size

    @staticmethod
    def kv_field_names() -> list[str]:
        """The KV settings in declaration order (everything reconfigure_kv may change)."""
        return [f.name for f in fields(KVSettings)]

    def kv_settings(self) -> dict[str, object]:
        """This object's KV settings by name (what the cache's config is built from)."""
        return {name: getattr(self, name) for name in self.kv_field_names()}
