# Issue 39's GPU part, fourth lease: answer ShareGPT's remaining first turns (parts 39-55 of the 10k set, which
# becomes 14,173 prompts), then train the shipped S3D draft on all of them at rank 16 and grown to rank 32, side by
# side, each stopped after $1 s of training; after two calls that carried the GGUF's first two parts.
T0=$(date +%s); T=${1:-240}; D=train/distilled/smollm2-sharegpt-10k
cp .carry/gguf/part-02 /tmp/ && cat /tmp/part-0* > /tmp/smollm2.gguf || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/gguf-*.whl && export PYTHONPATH=/tmp/site
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > /tmp/gpu.txt; python3 -c "import jax; print(jax.__version__, jax.devices())" >> /tmp/gpu.txt
JAX_DEFAULT_MATMUL_PRECISION=highest timeout ${2:-230} python3 -m train.distill --out $D --checkpoint /tmp/smollm2.gguf \
  --prompts 14173 --new-tokens 256 --max-prompt 192 --batch-size 256 --eval-fraction 0.05 --sort part > /tmp/distill.log 2>&1
echo "distilled at $(( $(date +%s) - T0 )) s"; tail -3 /tmp/distill.log
tar czf $OUT/parts.tar.gz $D/part-000[3-5]*.npz $D/manifest.json
python3 -m train.s3d --config configs/train/s3d-smollm2-gpu-14k.yaml checkpoint=/tmp/smollm2.gguf stop_after_s=$T \
  out=/tmp/r16 > /tmp/r16.log 2>&1 &
python3 -m train.s3d --config configs/train/s3d-smollm2-gpu-14k.yaml checkpoint=/tmp/smollm2.gguf stop_after_s=$T \
  lora_rank=32 out=/tmp/r32 > /tmp/r32.log 2>&1 &
wait; echo "trained at $(( $(date +%s) - T0 )) s"
for m in r16 r32; do tail -4 /tmp/$m.log; cp /tmp/$m/metrics.jsonl /tmp/$m-metrics.jsonl; done
cp /tmp/r16/draft.npz $OUT/r16-draft.npz; split -b 15M /tmp/r32/draft.npz $OUT/r32-draft.npz.part-
tar czf $OUT/logs.tar.gz -C /tmp gpu.txt distill.log r16.log r32.log r16-metrics.jsonl r32-metrics.jsonl
cat /tmp/gpu.txt; ls -la $OUT; echo "done at $(( $(date +%s) - T0 )) s"
