"""Process lifetime and resources: children that die with their launcher (lifeline.py), the glibc mmap
threshold that returns freed tensors to the OS (memory.py), the embedded Redis server (redis_server.py), and
how every service process starts and serves (service_main.py)."""
