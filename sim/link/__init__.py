"""The link emulator: a TCP proxy with delay, jitter, a bandwidth cap, stalls and disconnects
(proxy, shaping), its kernel-mode twin on network namespaces (netns), and `sprinter link` (command)."""
