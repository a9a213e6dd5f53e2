"""The KV cache's control plane, without torch: levels, slot allocators, block tables, the placement policy and
the capacity checks the scheduler asks before a step."""
