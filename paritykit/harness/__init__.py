"""The small shared core every check builds on.

tables (TableSpec, seeded weights, EC/EBC builders), plans (one plan type: normalise, validate,
describe, hand to torchrec), shards (one scatter/gather of sharded state with a coverage check),
patching (one patch/restore), devices (one device/backend resolver), seeding, versions, the CPU
stream shim, the planted-bug registry and the quieting of known noise. Nothing here imports
``paritykit.dist``, ``paritykit.checks`` or ``paritykit.gate``.
"""
