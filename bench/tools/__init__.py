"""Tools for kernel developers: profiles, compiled-kernel reports and tile sweeps (`python -m bench.tools.NAME`)."""
