#!/bin/bash
# On a host where batchjson runs from a source tree on PYTHONPATH (not pip-installed): register its vLLM plugin
# (entry point vllm.general_plugins, see pyproject.toml) by writing a dist-info next to the packages in $1
# (default /tmp/site), so that vLLM loads it in its engine processes too.
set -e
site=${1:-/tmp/site}
info="$site/batchjson_plugin-0.0.0.dist-info"
mkdir -p "$info"
printf 'Metadata-Version: 2.1\nName: batchjson-plugin\nVersion: 0.0.0\n' > "$info/METADATA"
printf '[vllm.general_plugins]\nbatchjson_runner = batchjson.engine.plugin:register\n' > "$info/entry_points.txt"
python3 -c "from importlib.metadata import entry_points as e; print([p.value for p in e(group='vllm.general_plugins')])"
