/* Internal to libkvfence: the Go side records the last error through this. */
#ifndef KVFENCE_LASTERROR_H
#define KVFENCE_LASTERROR_H

#include <stddef.h>

#define KVFENCE_TYPES_ONLY 1
#include "kvfence.h"

__attribute__((visibility("hidden"))) void kvf__set_last_error(const kvf_error_info *info, const char *msg, size_t len);

#endif
