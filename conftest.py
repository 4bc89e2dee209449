"""This repo's own suite: hypothesis profiles (dev / ci / release).

Choose with PARITYKIT_PROFILE=ci or `--hypothesis-profile ci` (the latter wins; hypothesis'
own pytest plugin applies it after this file has registered the profiles).
"""

from paritykit.gate.profiles import load_profile_from_env

load_profile_from_env()
