"""
Living on the machine: the systemd installer, join, the previous build, the instance lock, the
env file, sd_notify and the descriptor limit.
"""
