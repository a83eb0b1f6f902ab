module github.com/kvfence/kvfence

go 1.26
