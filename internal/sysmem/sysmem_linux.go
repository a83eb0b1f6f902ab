//go:build linux

package sysmem

import (
	"bufio"
	"bytes"
	"os"
	"strconv"
	"strings"
)

func available() (int64, bool) {
	avail, ok := memAvailable()
	if !ok {
		return 0, false
	}
	// cgroup v2, then v1: a limit and the usage charged against it. A
	// missing file or "max" means no limit there.
	for _, files := range [][2]string{
		{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"},
		{"/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"},
	} {
		limit, ok1 := readInt(files[0])
		used, ok2 := readInt(files[1])
		if ok1 && ok2 && limit > used {
			avail = min(avail, limit-used)
			break
		}
	}
	return avail, true
}

// memAvailable reads MemAvailable from /proc/meminfo (in kB there).
func memAvailable() (int64, bool) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Bytes()
		if !bytes.HasPrefix(line, []byte("MemAvailable:")) {
			continue
		}
		fields := strings.Fields(string(line[len("MemAvailable:"):]))
		if len(fields) == 0 {
			return 0, false
		}
		kb, err := strconv.ParseInt(fields[0], 10, 64)
		if err != nil || kb < 0 {
			return 0, false
		}
		return kb << 10, true
	}
	return 0, false
}

func readInt(path string) (int64, bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, false
	}
	v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
	return v, err == nil && v >= 0
}
