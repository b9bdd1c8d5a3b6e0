module dualpath-kv/third_party/llm-d-pd-sidecar

go 1.24.1

require github.com/llm-d/llm-d-inference-scheduler v0.5.1 // indirect
