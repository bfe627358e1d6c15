# Source on the GPU machine: `python` for scripts that call it (the image has python3 only),
# and the project's build in /tmp/site ahead of a staged framework stack.
#   . scripts/gpu_env.sh /root/site-sglang
mkdir -p /tmp/bin
printf '#!/bin/sh\nexec python3 "$@"\n' >/tmp/bin/python
chmod +x /tmp/bin/python
export PATH=/tmp/bin:$PATH
export PYTHONPATH=/tmp/site${1:+:$1}
export PYTHONUNBUFFERED=1
