#!/usr/bin/env bash
# Elastic restarts for an MPI job (what `--max-restarts` does for ranks as threads).
#
#   scripts/elastic_mpirun.sh [--max-restarts N] [--restart-grace SECONDS] [--replica P]
#       [--hostfile FILE] -np NP [other mpirun options] -- PROGRAM ARGS...
#
# PROGRAM (gpt_pretrain) must be given `--save DIR`. When the job fails, it is relaunched — up to
# N times — resuming from DIR's latest checkpoint (resharded onto the new world by the program):
# - with a hostfile: the wrapper waits up to SECONDS for its slots to reach NP again (a
#   replacement host joined) and relaunches at NP; otherwise at the most slots it has, rounded
#   down to a multiple of the replica size P (the processes of one data-parallel replica:
#   tp × pp × cp; default 1);
# - without one, nothing can join: it relaunches at once on NP − P processes.
# The global batch is the program's (`--batch-size` is global); a `--dp V` is scaled with the
# world; `--fail-at` (a test hook) is dropped after the first attempt.
#
# What MPI itself cannot survive: the loss of one process ends the whole MPI job (errors are
# fatal, and the fault-tolerant ULFM extension is not standard MPI), so every process is
# relaunched and in-memory state is lost — a restart always reads the disk checkpoint.
set -euo pipefail

max_restarts=1 grace=0 replica=1 hostfile="" np=""
mpirun_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --max-restarts) max_restarts=$2; shift 2 ;;
        --restart-grace) grace=$2; shift 2 ;;
        --replica) replica=$2; shift 2 ;;
        --hostfile) hostfile=$2; mpirun_args+=(--hostfile "$2"); shift 2 ;;
        -np | -n) np=$2; shift 2 ;;
        --) shift; break ;;
        *) mpirun_args+=("$1"); shift ;;
    esac
done
[ -n "$np" ] && [ $# -gt 0 ] || { sed -n '4,6p' "$0" >&2; exit 2; }
program=("$@")

# The program's --save directory and --dp, read from its arguments.
save="" dp=""
for ((i = 0; i < ${#program[@]}; i++)); do
    case "${program[$i]}" in
        --save) save=${program[$((i + 1))]} ;;
        --dp) dp=${program[$((i + 1))]} ;;
    esac
done
[ -n "$save" ] || { echo "elastic_mpirun.sh: the program needs --save DIR to resume from" >&2; exit 2; }

slots() { # the slots a hostfile lists (one per line without slots=)
    awk '!/^[[:space:]]*(#|$)/ { n = 1; for (i = 1; i <= NF; i++) if ($i ~ /^slots=/) { split($i, s, "="); n = s[2] } total += n } END { print total + 0 }' "$1"
}

world=$np attempt=0
while true; do
    args=()
    for ((i = 0; i < ${#program[@]}; i++)); do
        a=${program[$i]}
        case "$a" in
            --fail-at | --resume)
                # The hook only on the first attempt; the resume is the latest checkpoint.
                if [ "$a" = --resume ] && [ ! -f "$save/latest" ]; then args+=("$a" "${program[$((i + 1))]}"); fi
                if [ "$a" = --fail-at ] && [ "$attempt" = 0 ]; then args+=("$a" "${program[$((i + 1))]}"); fi
                i=$((i + 1)) ;;
            --dp) args+=(--dp "$((dp * world / np))"); i=$((i + 1)) ;;
            *) args+=("$a") ;;
        esac
    done
    resumed=0
    if [ -f "$save/latest" ]; then
        args+=(--resume "$save")
        resumed=$(sed -n 's/^step-0*//p' "$save/latest")
        resumed=${resumed:-0}
    fi
    started=$(date +%s.%N)
    if mpirun "${mpirun_args[@]}" -np "$world" "${args[@]}"; then
        exit 0
    fi
    failed=$(date +%s.%N)
    if [ "$attempt" -ge "$max_restarts" ]; then
        echo "elastic_mpirun.sh: the job failed and the $max_restarts restart(s) are used" >&2
        exit 1
    fi
    attempt=$((attempt + 1))
    next=$((world - replica))
    if [ -n "$hostfile" ]; then
        deadline=$(($(date +%s) + ${grace%.*}))
        while [ "$(slots "$hostfile")" -lt "$np" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 1; done
        have=$(slots "$hostfile")
        next=$(( (have < np ? have : np) / replica * replica ))
    fi
    if [ "$next" -lt "$replica" ] || [ "$next" -lt 1 ]; then
        echo "elastic_mpirun.sh: no whole replica of $replica process(es) is left to restart on" >&2
        exit 1
    fi
    latest=$(sed -n 's/^step-0*//p' "$save/latest" 2>/dev/null || true)
    echo "elastic_mpirun.sh: restart $attempt: the job of $world processes failed after $(awk "BEGIN { printf \"%.1f\", $failed - $started }") s; relaunching on $next from step ${latest:-0} (the last attempt started from step $resumed)" >&2
    world=$next
done
