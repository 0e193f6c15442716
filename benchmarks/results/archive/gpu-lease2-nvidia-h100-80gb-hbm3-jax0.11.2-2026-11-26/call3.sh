# Parts 12-39 of the distilled answers (fp32, full-precision matmuls), then S3D and Kangaroo trained on all of them
# side by side, with the tree-attention tests beside them. Budget: the whole call within ~560 s.
T0=$(date +%s)
cp .carry/gguf/part-02 /tmp/ && cat /tmp/part-0* > /tmp/smollm2.gguf || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry/whl/gguf-*.whl && export PYTHONPATH=/tmp/site
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
D=train/distilled/smollm2-sharegpt-10k
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 230 python3 -m train.distill --checkpoint /tmp/smollm2.gguf --out $D \
  --prompts 10000 --new-tokens 256 --max-prompt 192 --part-rows 256 --batch-size 256 --eval-fraction 0.05 --sort part \
  > /tmp/distill.log 2>&1; echo "distill rc $? at $(( $(date +%s) - T0 )) s"; tail -3 /tmp/distill.log
cp $D/manifest.json $OUT/
tar cf $OUT/parts-a.tar $(ls $D/part-000{12..25}.npz 2>/dev/null); tar cf $OUT/parts-b.tar $(ls $D/part-000{26..39}.npz 2>/dev/null)
T=$(( 370 - ($(date +%s) - T0) )); echo "training for $T s"
for m in s3d kangaroo; do
  python3 -m train.$m --config configs/train/$m-smollm2-gpu-10k.yaml checkpoint=/tmp/smollm2.gguf stop_after_s=$T \
    out=/tmp/$m > /tmp/$m.log 2>&1 &
done
wait; echo "trained at $(( $(date +%s) - T0 )) s"
for m in s3d kangaroo; do tail -4 /tmp/$m.log; cp /tmp/$m/draft.npz $OUT/$m-draft.npz; cp /tmp/$m/metrics.jsonl /tmp/$m-metrics.jsonl; done
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > /tmp/gpu.txt
tar czf $OUT/logs.tar.gz -C /tmp distill.log s3d.log kangaroo.log s3d-metrics.jsonl kangaroo-metrics.jsonl gpu.txt
ls -la $OUT; echo "done at $(( $(date +%s) - T0 )) s"
