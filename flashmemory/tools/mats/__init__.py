"""MATS, the KV-memory stress and integrity suites behind `flashmemory-test mats --level N --duration S`.

temporal.py (MATS-1) and coherence.py (MATS-2) drive a real TieredKVCache on synthetic keys and values through a
CacheDriver (driver.py) and a RandomWorkload (workload.py), checking every read against a shadow copy
(shadow.py, checker.py, bounds.py) and the slot accounting (accounting.py); MATS-2 adds a faulty disk (faults.py)
and watchers on the prefetch read path (read_watch.py). endurance.py (MATS-3) loads a real server
(server_process.py, traffic.py) and watches the GPU (gpu_watch.py). report.py renders what any suite found;
command.py is the command line.
"""
