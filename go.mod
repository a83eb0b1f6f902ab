module github.com/kvfence/kvfence

go 1.26

require github.com/stretchr/testify v1.12.1

require (
	github.com/NVIDIA/go-nvml v0.13.4-1 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
)
