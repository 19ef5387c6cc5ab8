#!/bin/bash
# Training longer than the partition's time limit, as a chain: N jobs of the same name, each
# starting when the previous one has ended (--dependency=singleton). Every job runs the same
# script; `--rdzv-id` names the whole chain (each job has its own SLURM_JOB_ID), so all of
# them use one run directory and resume from its checkpoint. A job whose training is
# already complete exits at once (the script sees its last step in the checkpoint).
#
#   examples/slurm/chain.sh 5 examples/slurm/static.sbatch
set -euo pipefail
count=${1:?number of jobs}
script=${2:?sbatch script}
name=${3:-flexrun-chain}
for _ in $(seq "$count"); do
    sbatch --job-name="$name" --dependency=singleton \
        --export=ALL,PET_RDZV_ID="$name" "$script"
done
