"""The prompt-cache doctor: prompt parts in, keys, an index (in process or shared),
findings out. How much of a prompt repeated a recent request's prefix, how much the
upstream reported cached, and where and why the prefix broke.

Design: ``docs/design/doctor.md``.
"""
