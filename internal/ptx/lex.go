package ptx

import "fmt"

// token is a word (identifier, opcode with its modifiers, directive,
// register, number) or one punctuation character, with its line.
type token struct {
	text string
	line int
}

func isWordByte(c byte) bool {
	return c == '_' || c == '$' || c == '%' || c == '.' ||
		'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9'
}

// lex splits src into tokens, dropping whitespace and comments.
func lex(src []byte) ([]token, error) {
	var toks []token
	line := 1
	for i := 0; i < len(src); {
		c := src[i]
		switch {
		case c == '\n':
			line++
			i++
		case c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v':
			i++
		case c == '/' && i+1 < len(src) && src[i+1] == '/':
			for i < len(src) && src[i] != '\n' {
				i++
			}
		case c == '/' && i+1 < len(src) && src[i+1] == '*':
			start := line
			i += 2
			for {
				if i+1 >= len(src) {
					return nil, &SyntaxError{Line: start, Msg: "unterminated /* comment"}
				}
				if src[i] == '*' && src[i+1] == '/' {
					i += 2
					break
				}
				if src[i] == '\n' {
					line++
				}
				i++
			}
		case isWordByte(c):
			j := i
			for j < len(src) && isWordByte(src[j]) {
				j++
			}
			toks = append(toks, token{string(src[i:j]), line})
			i = j
		case c == ',' || c == ';' || c == ':' || c == '[' || c == ']' || c == '{' || c == '}' ||
			c == '(' || c == ')' || c == '<' || c == '>' || c == '+' || c == '-' || c == '@' || c == '!':
			toks = append(toks, token{string(c), line})
			i++
		case c == 0 && i == len(src)-1:
			i++ // the NUL a driver image ends with
		default:
			return nil, &SyntaxError{Line: line, Msg: fmt.Sprintf("unexpected character %q", c)}
		}
	}
	return toks, nil
}
