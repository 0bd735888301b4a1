#!/usr/bin/env bash
# Checks of the Program contract (core/include/piper/core/program.hpp, ARCHITECTURE.md):
#   no-tag-by-name SOURCE_DIR
#     No consumer reads a DAG/op tag by the name "MB": they read Op::microbatch. The only files
#     that may name "MB" are those that produce tags or directives (the split directive's default
#     dimension, the schedule generators, the PyTorch CSV import) or print tags as labels.
#   no-meeting-by-node SOURCE_DIR
#     No consumer outside core reads an op's DAG node (Op::node): who meets whom at a transfer or a
#     collective is keyed by the pairing id (Op::pair, core/readiness.hpp). Comment lines and the
#     cluster's own "node" fields (NodeSpec, a call cluster.node(d)) are not ops'.
#   no-directive-json SOURCE_DIR
#     Front ends (the strategy generator, schedules, scenarios, search, the CLI, GUI, Python) build the
#     typed directive program (core::ProgramBuilder, core::DirectiveProgram) and never write or read a
#     directive's JSON by hand: no object literal with a directive's "op", no ["op"] / value("op") /
#     contains("op") read, no ["filter"], ["filters"], ["num_microbatches"], ["holds"], ["dim_name"] edit.
#     Allowed: the parser (core/src/directives.cpp), the one serializer (core/src/program_builder.cpp)
#     and the GUI editor's text layout of the program the user edits (gui/src/directive_editor.cpp).
#   no-boost SOURCE_DIR CXX NLOHMANN_INCLUDE_DIR
#     program.hpp's include closure (the compiler's -M listing of a file that includes only it)
#     holds no Boost header.
set -euo pipefail
mode=${1:?mode}
src=${2:?source dir}
cd "$src"
case "$mode" in
  no-tag-by-name)
    allowed='^(core/src/dag\.cpp|core/src/directives\.cpp|core/include/piper/core/directives\.hpp|core/src/schedules\.cpp|core/src/pytorch_csv\.cpp|core/include/piper/core/model\.hpp):'
    hits=$(grep -rn --include='*.cpp' --include='*.hpp' --include='*.h' --include='*.cu' --include='*.py' '"MB"' \
             core sim search gpu_runtime gui cli chakra python | grep -Ev "$allowed" || true)
    if [[ -n "$hits" ]]; then
      echo "tags read by the name \"MB\" (use core::Op::microbatch):"
      echo "$hits"
      exit 1
    fi
    # The allowed files must still exist, or the list above is stale.
    for f in core/src/dag.cpp core/src/directives.cpp core/include/piper/core/directives.hpp core/src/schedules.cpp core/src/pytorch_csv.cpp; do
      [[ -f "$f" ]] || { echo "stale allowance: $f does not exist"; exit 1; }
    done
    echo "no consumer reads a tag by the name \"MB\""
    ;;
  no-meeting-by-node)
    allowed='^sim/src/cluster\.cpp:[0-9]+:  c\.nodes\.assign'
    hits=$(grep -rnE --include='*.cpp' --include='*.hpp' --include='*.h' --include='*.cu' '\.node\b($|[^(])' \
             sim search gpu_runtime gui cli chakra python | grep -Ev '^[^:]+:[0-9]+:[[:space:]]*//' | grep -Ev "$allowed" || true)
    if [[ -n "$hits" ]]; then
      echo "ops read by their DAG node outside core (meet them by core::Op::pair, core/readiness.hpp):"
      echo "$hits"
      exit 1
    fi
    echo "no consumer outside core reads an op's DAG node"
    ;;
  no-directive-json)
    allowed='^(core/src/directives\.cpp|core/src/program_builder\.cpp|gui/src/directive_editor\.cpp):'
    ops='place|replicate|shard|split|order|tensor_parallel|recompute|sm_partition|context_parallel'
    pattern='"op"[[:space:]]*,[[:space:]]*"('"$ops"')"|\["op"\]|(value|contains|at|find)\("op"|\["(filter|filters|num_microbatches|holds|dim_name)"\]'
    hits=$(grep -rnE --include='*.cpp' --include='*.hpp' --include='*.h' --include='*.cu' "$pattern" \
             core sim search gpu_runtime gui cli chakra plot python | grep -Ev '^[^:]+:[0-9]+:[[:space:]]*//' |
             grep -Ev "$allowed" || true)
    if [[ -n "$hits" ]]; then
      echo "directive JSON written or read by hand (build the typed program: core::ProgramBuilder, core::DirectiveProgram):"
      echo "$hits"
      exit 1
    fi
    for f in core/src/directives.cpp core/src/program_builder.cpp gui/src/directive_editor.cpp; do
      [[ -f "$f" ]] || { echo "stale allowance: $f does not exist"; exit 1; }
    done
    # The check must see what it forbids: the serializer it allows writes directive JSON.
    grep -qE "$pattern" core/src/program_builder.cpp || { echo "the pattern no longer matches the serializer"; exit 1; }
    echo "no front end writes or reads directive JSON by hand"
    ;;
  no-boost)
    cxx=${3:?compiler}
    json_dir=${4:?nlohmann include dir}
    deps=$(echo '#include "piper/core/program.hpp"' |
           "$cxx" -std=c++20 -M -x c++ -I core/include -I "$json_dir" - )
    # The listing must name program.hpp (the check ran) and no Boost header.
    grep -q 'piper/core/program\.hpp' <<<"$deps" || { echo "the -M listing does not name program.hpp:"; echo "$deps"; exit 1; }
    if grep -qi 'boost' <<<"$deps"; then
      echo "program.hpp includes Boost:"
      tr ' ' '\n' <<<"$deps" | grep -i boost
      exit 1
    fi
    if grep -q 'piper/core/dag\.hpp' <<<"$deps"; then
      echo "program.hpp includes dag.hpp"
      exit 1
    fi
    echo "program.hpp's include closure holds no Boost header and not dag.hpp"
    ;;
  *)
    echo "unknown mode '$mode' (expected no-tag-by-name, no-meeting-by-node, no-directive-json or no-boost)"
    exit 2
    ;;
esac
