"""The shared level: full KV blocks in a Redis every replica reaches, named by the prefix cache's
chain hash, so a replica that never saw a prefix reads it instead of computing it."""
